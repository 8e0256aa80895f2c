"""The process groups of a Parm layer: MP (tensor parallel), ESP (expert sharding) and EP (expert parallel).

Layout (DeepSpeed's E+M+D, ``deepspeed/utils/groups.py``; parm.md §5.5), world 8, tp 2, ep 2:

    mp   [0,1] [2,3] [4,5] [6,7]          consecutive ranks, from the mpu (Megatron or ModelParallelUnit)
    esp  [0,1] [2,3] [4,5] [6,7]          same ranks as mp, a separate communicator (so that an ESP
                                          reduce-scatter and an MP all-gather can run at the same time)
    ep   [0,2] [4,6] [1,3] [5,7]          DeepSpeed's expert-parallel groups, strided by tp
    edp  [0,4] [2,6] [1,5] [3,7]          DeepSpeed's expert-data-parallel groups (gradients only)

ESP = MP when the layer shards its experts (``enable_expert_tensor_parallelism``), otherwise ESP = 1 and
DeepSpeed's legacy groups are used unchanged. The groups are named for the ledger "mp", "esp", "ep".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from commweave import comm


def check_layout(world_size: int, tp: int, ep: int, num_experts: int) -> None:
    """ValueError unless ``num_experts % ep == 0`` and ``tp * ep`` divides the world."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"num_experts={num_experts} must be divisible by ep_size={ep} "
                         "(every EP rank holds num_experts / ep_size experts)")
    if world_size % (tp * ep):
        raise ValueError(f"tensor-parallel size {tp} x ep_size {ep} = {tp * ep} must divide the world size "
                         f"{world_size}")


class ModelParallelUnit:
    """A minimal Megatron-style ``mpu`` for ``deepspeed.initialize(mpu=...)`` when Megatron is not used.

    Tensor-parallel groups are blocks of ``tensor_parallel_size`` consecutive ranks, data-parallel
    groups are strided by it (DeepSpeed's ``_create_model_parallel`` layout). Collective: every rank of
    the world constructs it, in the same order.
    """

    def __init__(self, tensor_parallel_size: int) -> None:
        world, me = dist.get_world_size(), dist.get_rank()
        if tensor_parallel_size < 1 or world % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1 and divide the world "
                             f"size {world}")
        tp = tensor_parallel_size
        self._tp_ranks = list(range(me // tp * tp, me // tp * tp + tp))
        self._dp_ranks = list(range(me % tp, world, tp))
        self._tp = self._dp = None
        for start in range(0, world, tp):
            group = comm.new_group(range(start, start + tp), name="mp")
            if me in range(start, start + tp):
                self._tp = group
        for lane in range(tp):
            group = comm.new_group(range(lane, world, tp), name="dp")
            if me % tp == lane:
                self._dp = group

    def get_tensor_model_parallel_group(self):
        return self._tp

    def get_tensor_model_parallel_world_size(self) -> int:
        return len(self._tp_ranks)

    def get_tensor_model_parallel_rank(self) -> int:
        return self._tp_ranks.index(dist.get_rank())

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tp_ranks[0]

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return len(self._dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return self._dp_ranks.index(dist.get_rank())

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


@dataclass(frozen=True)
class ParmGroups:
    """One layer's groups; a group of size 1 is ``None`` (its collectives are skipped)."""

    mp: object
    esp: object
    ep: object
    mp_size: int
    mp_rank: int
    esp_size: int
    esp_rank: int
    ep_size: int
    ep_rank: int

    @classmethod
    def build(cls, mp_group, ep_group, shard_experts: bool) -> ParmGroups:
        """From the mpu's tensor-parallel group (or None) and DeepSpeed's expert-parallel group."""
        mp_size = 1 if mp_group is None else comm.size(mp_group)
        mp = mp_group if mp_size > 1 else None
        ep_size = comm.size(ep_group)
        ep = ep_group if ep_size > 1 else None
        if mp is not None:
            comm.set_group_name(mp, "mp")
        if ep is not None:
            comm.set_group_name(ep, "ep")
        esp = _esp_clone(mp) if shard_experts and mp is not None else None
        return cls(mp=mp, esp=esp, ep=ep,
                   mp_size=mp_size, mp_rank=0 if mp is None else comm.rank(mp),
                   esp_size=1 if esp is None else mp_size, esp_rank=0 if esp is None else comm.rank(mp),
                   ep_size=ep_size, ep_rank=comm.rank(ep_group))


_ESP: dict[tuple[int, ...], object] = {}


def _esp_clone(mp_group):
    """A second communicator over the MP ranks, created once per process for all layers.

    Creating groups is collective over the world, so every rank creates the clones of all MP groups;
    that needs the MP groups to be blocks of consecutive ranks (Megatron's and DeepSpeed's layout).
    """
    ranks = tuple(dist.get_process_group_ranks(mp_group))
    n, world = len(ranks), dist.get_world_size()
    if ranks != tuple(range(ranks[0], ranks[0] + n)) or ranks[0] % n:
        raise ValueError("Parm expert sharding needs tensor-parallel groups of consecutive ranks, "
                         f"got {ranks}")
    if ranks not in _ESP:
        for start in range(0, world, n):
            block = tuple(range(start, start + n))
            group = comm.new_group(block, name="esp")
            if block == ranks:
                _ESP[ranks] = group
    return _ESP[ranks]
