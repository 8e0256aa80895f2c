"""The job's process groups: one sequence split over every rank, MoE layers on teams of ``tp`` ranks.

World of W ranks, tensor-parallel (MP) size tp, expert-parallel size ep (W = tp x ep x edp):

    cp     [0 .. W-1]              attention: the sequence in zigzag shards over all W ranks (WallFacer)
    mp     [0,1] [2,3] ...         the MoE's MP = ESP group: tp consecutive ranks, which are also
                                   WallFacer's teams (contiguous placement, team size C = tp)
    ep     [0,2] [1,3] ...         DeepSpeed's expert-parallel groups, strided by tp
    grads  [0 .. W-1]              DeepSpeed's gradient reduction and ZeRO partitions (below)

DeepSpeed's MoE (and Parm, its drop-in) takes its input replicated over the MP ranks, as after a
tensor-parallel attention. Here each rank holds its own tokens, so the job gathers the team's tokens
before each MoE layer and keeps its own rows after it, with the duals of Megatron's sequence
parallelism (``ds_plugins.collectives``): ``gather_rows`` (all-gather; backward keeps this rank's rows,
since the replicated consumer hands every rank the full gradient) and ``split_rows`` (keep own rows;
backward all-gathers, so that the MoE sees replicated gradients as its TP contract requires).

Gradients. Non-expert parameters are replicated on all W ranks but see different tokens, so DeepSpeed
must reduce them over the whole world, not over its data-parallel group: :class:`SequenceParallelUnit`
tells it so the way DeepSpeed-Ulysses does, with a sequence-parallel group (the MP ranks, sp = tp) and
a sequence-data-parallel group (the world). DeepSpeed then sums gradients over the W ranks and divides
by W / sp = W / tp. The loss a rank backpropagates is therefore its token-mean cross entropy / tp
(model.py), so that the result is the gradient of the mean over all tokens; the two quantities that
are replicated over the MP ranks get the team's full gradient instead (model.py: the gate weight's
gradient is divided by tp, since each of the tp MP ranks holds all of it; the MoE auxiliary loss's
gradient is summed over MP). tests/examples/test_gpt_exact.py checks the result against one process.
"""

from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe import mappings
from deepspeed.utils import groups as ds_groups

from commweave import comm
from ds_plugins import ModelParallelUnit


class SequenceParallelUnit(ModelParallelUnit):
    """ds_plugins.ModelParallelUnit (MP groups of ``tp`` consecutive ranks, data-parallel groups strided
    by tp) plus DeepSpeed's sequence-parallel hooks: the MP ranks split the tokens (sp = tp) and
    gradients are reduced over the world. Collective: every rank constructs it, in the same order."""

    def __init__(self, tensor_parallel_size: int) -> None:
        super().__init__(tensor_parallel_size)
        world = range(dist.get_world_size())
        self.cp_group = comm.new_group(world, name="cp")          # attention
        self.grad_group = comm.new_group(world, name="grads")     # DeepSpeed's reduction and ZeRO

    def get_sequence_parallel_group(self):
        return self.get_tensor_model_parallel_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    def get_sequence_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    def get_sequence_data_parallel_group(self):
        return self.grad_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()


def check_layout(world: int, tp: int, ep: int, experts: int, heads: int, seq: int, team_size: int) -> None:
    """ValueError naming the argument and the rule, on every rank before any collective."""
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} must divide the world size {world}")
    if ep < 1 or world % (tp * ep):
        raise ValueError(f"--tp {tp} x --ep {ep} = {tp * ep} must divide the world size {world}")
    if experts % ep:
        raise ValueError(f"--experts {experts} must be divisible by --ep {ep}")
    if seq % (2 * world):
        raise ValueError(f"--seq {seq} must be divisible by 2 x world size = {2 * world} (zigzag shards)")
    if team_size < 1 or world % (team_size * team_size):
        raise ValueError(f"--wallfacer-team-size {team_size}: C² must divide the context-parallel size "
                         f"{world} (1 = ring attention)")
    if heads < 1:
        raise ValueError(f"--heads {heads} must be >= 1")


def expert_parallel_rank(tp: int, ep: int) -> int:
    """This rank's index in its DeepSpeed expert-parallel group (before DeepSpeed creates the groups)."""
    ep_groups, _ = ds_groups._get_expert_parallel_ranks(dist.get_world_size(), tp, ep)
    me = dist.get_rank()
    return next(ranks.index(me) for ranks in ep_groups if me in ranks)


def name_deepspeed_groups(engine) -> None:
    """Readable ledger labels for the groups DeepSpeed created (expert parallel and expert data parallel)."""
    for name, group in engine.expert_parallel_group.items():
        if dist.get_world_size(group) > 1:
            comm.set_group_name(group, "ep")
        edp = engine.expert_data_parallel_group[name]
        if dist.get_world_size(edp) > 1:
            comm.set_group_name(edp, "edp")


def _gather_tokens_gloo(input_, dim=0):
    """DeepSpeed's ``mappings._gather_tokens`` with a ``[tp·d0, ...]`` buffer: the same maths.

    DeepSpeed all-gathers an N-d tensor into a flat buffer, which torch's gloo backend rejects
    ("ProcessGroupGloo::allgather: invalid tensor size", design/traps.md), so DeepSpeed's MoE with
    tensor parallelism cannot run on CPU as shipped (deepspeed 0.19.8).
    """
    group = ds_groups.mpu.get_tensor_model_parallel_group() if ds_groups.mpu is not None else None
    if group is None or dist.get_world_size(group) == 1:
        return input_
    input_ = input_.contiguous()
    out = input_.new_empty((dist.get_world_size(group) * input_.shape[0], *input_.shape[1:]))
    comm.all_gather(out, input_, group)
    return torch.cat(out.chunk(dist.get_world_size(group)), dim=dim).contiguous()


def deepspeed_moe_on_gloo() -> None:
    """Let DeepSpeed's own MoE (the features-off run) gather tokens on gloo; nothing changes on NCCL."""
    if dist.get_backend() == "gloo":
        mappings._gather_tokens = _gather_tokens_gloo


def init_distributed() -> None:
    deepspeed.init_distributed(dist_backend=deepspeed.get_accelerator().communication_backend_name())
