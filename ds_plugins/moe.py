"""ParmMoE: DeepSpeed's MoE layer with Parm's dedicated schedules (Pan et al., INFOCOM 2024).

A subclass of ``deepspeed.moe.layer.MoE``, so the engine finds it (it detects MoE layers with
``isinstance``), creates its expert-parallel groups through ``set_deepspeed_parallelism`` and reduces its
expert gradients over the expert-data-parallel groups; the gate and the experts are DeepSpeed's own
modules with DeepSpeed's parameter tags. Only the forward differs:

    agree on the token count -> schedule ("deepspeed" | "s1" | "s2", or "auto" per agreed shape)
        -> (output, l_aux, exp_counts)

(where the forward is sync-free, ds_plugins.schedules.sync_free, the token count travels in the header of
the schedule's fill exchange instead of its own agreement)

with the output replicated over the MP ranks, as DeepSpeed's. Every schedule routes exactly as
DeepSpeed's gate on the whole batch, so the schedule changes the speed, never the result; the forward
issues collectives on the layer's own groups only (ds_plugins.agreement, ds_plugins.selector), and works
in training and eval, under ``torch.no_grad()`` / ``torch.inference_mode()`` and activation
checkpointing (a recompute runs its forward's schedule, ds_plugins.recompute).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import MOE_TIMER
from deepspeed.utils import groups as ds_groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size
from torch import nn

from commweave import comm
from ds_plugins import agreement, checkpoint, experts, inputs, moe_timers, recompute, selector
from ds_plugins import cost_cache as cost_cache_file
from ds_plugins.config import ParmConfig, check_cost_cache_type, check_overlap_chunks, check_schedule
from ds_plugins.groups import ParmGroups, check_layout
from ds_plugins.schedules import SCHEDULES, refuse, sync_free


class ParmMoE(MoE):
    """``deepspeed.moe.layer.MoE`` with Parm's schedules.

    Arguments: every argument of ``deepspeed.moe.layer.MoE`` (same names, order and defaults), and

        schedule (str): "auto" (default), "s1", "s2" or "deepspeed" (parm.md §2).
        overlap_chunks (int): pipeline chunks of the overlapped exchanges, >= 1 (default 4).
        skip_empty_slots (bool): run the experts only on the capacity slots that hold a token (default).
        debug (bool): check in every S2 and "deepspeed" forward that routing is identical across the MP
            ranks.
        cost_cache (str, optional): JSON file for the "auto" selector's fitted alpha-beta parameters.

    With ``enable_expert_tensor_parallelism`` the experts are sharded over ESP = the tensor-parallel group
    when DeepSpeed creates the groups (a two-layer MLP, ``ds_plugins.experts.SwiGLU`` or any expert with the
    sharding protocol of ds_plugins.experts); otherwise ESP = 1 and any expert module works. Its
    ``state_dict`` holds the unsharded experts either way (ds_plugins.checkpoint), as DeepSpeed's MoE does.
    ``use_tutel=True`` is refused: Parm has its own fused dispatch and combine.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False, top2_2nd_expert_sampling: bool = True, *,
                 schedule: str = "auto", overlap_chunks: int = 4, skip_empty_slots: bool = True,
                 debug: bool = False, cost_cache: str | None = None) -> None:
        error = inputs.layer_args_error(
            hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, use_residual=use_residual, drop_tokens=drop_tokens, use_rts=use_rts,
            enable_expert_tensor_parallelism=enable_expert_tensor_parallelism,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        if error is not None:
            raise ValueError(f"ParmMoE: {error}")
        check_tutel(use_tutel)
        # The file's directory may be node-local, so one rank alone can refuse it: that refusal waits for
        # set_deepspeed_parallelism, whose agreement makes every rank raise it (the others are the same on
        # every rank: the constructor's arguments)
        cache_error = None
        if check_cost_cache_type(cost_cache) is not None:
            try:
                cost_cache_file.check(cost_cache)
            except ValueError as e:
                cache_error = f"ParmMoE: {e}"
        config = ParmConfig(enabled=True, schedule=schedule, overlap_chunks=overlap_chunks,
                            skip_empty_slots=skip_empty_slots, debug=debug)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        self._init_parm(config)
        self.cost_cache, self._setup_error = cost_cache, cache_error

    @classmethod
    def from_moe(cls, moe: MoE, config: ParmConfig) -> ParmMoE:
        """A ParmMoE holding ``moe``'s modules and parameters (the same objects, not copies)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        for name, value in vars(moe).items():
            if not name.startswith("_"):
                setattr(layer, name, value)
        for name, child in moe.named_children():
            layer.add_module(name, child)
        layer._init_parm(config)
        return layer

    def _init_parm(self, config: ParmConfig) -> None:
        self.schedule = check_schedule(config.schedule)
        self.overlap_chunks = check_overlap_chunks(config.overlap_chunks)
        self.skip_empty_slots = config.skip_empty_slots
        self.debug = config.debug
        self.cost_cache = config.cost_cache
        self._setup_error: str | None = None
        self.parm_groups: ParmGroups | None = None
        self.last_schedule: str | None = None
        self.picks = recompute.Picks()
        self.seen_tokens: int | None = None
        """The largest token count on the headers of the layer's last forward that passed their check (the
        same on every rank of the layer, ds_plugins.schedules.sync_free), or None before any."""

    @property
    def gate(self):
        return self.deepspeed_moe.gate

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Validate the layout and the experts (before any collective), let DeepSpeed create its groups,
        then add Parm's, shard the experts over ESP and, for "auto", fit the cost model on the layer's
        groups (ds_plugins.selector). Collective: every rank calls it, once per layer."""
        if self.parm_groups is not None:
            raise RuntimeError(
                "ParmMoE.set_deepspeed_parallelism() was already called for this layer (its process groups "
                "exist and its experts are sharded over ESP); it runs once per layer: deepspeed.initialize "
                "and ds_plugins.initialize call it, so do not call it yourself before them (only when you "
                "use the layer without an engine)")
        tp = bwc_tensor_model_parallel_world_size(ds_groups.mpu)
        esp = tp if self.enable_expert_tensor_parallelism else 1
        try:
            check_layout(comm.size(torch.distributed.group.WORLD), tp, self.ep_size, self.num_experts)
            for expert in self.local_experts:
                experts.check_shardable(expert, esp)
            error = self._setup_error
        except ValueError as e:
            error = f"ParmMoE.set_deepspeed_parallelism: {e}"
        if self.expert_group_name not in ds_groups._get_expert_parallel_group_dict():
            # DeepSpeed is about to create the groups, collectively over the world: every rank is here
            comm.agree(torch.distributed.group.WORLD, "ParmMoE set-up", error)
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_)
        mp = bwc_tensor_model_parallel_group(ds_groups.mpu) if tp > 1 else None
        agreement.settings(self, mp, self.deepspeed_moe.ep_group, error)   # same layer on every rank
        self.parm_groups = ParmGroups.build(mp, self.deepspeed_moe.ep_group, shard_experts=esp > 1)
        if esp > 1:
            for expert in self.local_experts:
                experts.shard_(expert, self.parm_groups.esp_rank, esp, self.parm_groups.esp)
            checkpoint.register_layer_hooks(self)
        if self.schedule == "auto":
            selector.fit(self)

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.parm_groups is None:
            raise RuntimeError("ParmMoE has no process groups yet: deepspeed.initialize (or "
                               "ds_plugins.initialize) calls set_deepspeed_parallelism(); call it yourself "
                               "when using the layer alone")
        error = inputs.forward_error(self, hidden_states, used_token)
        x = None if error else hidden_states.reshape(-1, hidden_states.shape[-1])
        with moe_timers.timed(self.deepspeed_moe, MOE_TIMER):
            error = error and f"ParmMoE.forward: {error}"
            if sync_free(self):      # the sizes are checked on the fill exchange's headers instead
                if self.schedule == "auto":    # fitted at set-up; switched to "auto" since: fit on every
                    selector.fit(self)         # rank here, before a refusal's exchange
                if error:
                    refuse(self, error)
                # drop mode: every rank's S is the layer's (the headers check it); without dropping the
                # largest S of the previous forward, the same on every rank (schedules.sync_free)
                tokens = x.shape[0] if self.gate.drop_tokens else self.seen_tokens
            else:
                tokens = agreement.tokens(0 if error else x.shape[0], self.gate.training,
                                          self.gate.drop_tokens, self.parm_groups, self.gate.wg.weight.device,
                                          error)
            if self.schedule == "auto":          # a recompute replays its forward's pick (recompute.Picks)
                key = (self.gate.training, x.dtype, x.shape[0] if self.gate.drop_tokens else None)
                schedule = self.picks.schedule(key, lambda: selector.choose(self, tokens, x.dtype))
            else:
                schedule = self.schedule
            self.last_schedule = schedule
            out, l_aux, exp_counts = SCHEDULES[schedule](self, x, used_token)
        self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts = l_aux, exp_counts
        output = out.reshape(hidden_states.shape)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, exp_counts


def check_tutel(use_tutel) -> None:
    """ValueError for ``use_tutel=True``, which DeepSpeed silently ignores when Tutel is missing."""
    if use_tutel:
        raise ValueError(f"use_tutel={use_tutel!r}: ParmMoE does not run Tutel's dispatcher (it has its own "
                         "fused dispatch and combine, ds_plugins.dispatch); set use_tutel=False")
