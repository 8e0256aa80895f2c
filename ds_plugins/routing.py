"""Routing with DeepSpeed's own gate, minus its hidden collective, plus what S1 needs (parm.md §2.8).

``route`` is ``TopKGate.forward`` step for step (fp32 logits, 'Jitter' on the input, top-1 / top-2 /
top-k gating from ``deepspeed.moe.sharded_moe``), called with ``ep_group=None`` so that the no-drop
capacity all-reduce is not issued behind our back: the schedules agree on the capacity themselves, over
the groups their layout needs (:func:`agree_capacity`). It draws random numbers exactly as the gate does,
so S2 and "deepspeed" route bit-identically to DeepSpeed's MoE from the same RNG state.

S1 gates a 1/N shard of the tokens. Its auxiliary loss and expert counts must still be those of the full
token set, so :func:`route` also returns the per-expert statistics the loss is made of,

    me_e = mean_s softmax(logits)_se      ce_e = fraction of tokens whose (first) choice is e
    l_aux = Σ_e me_e·ce_e·E  (k = 1),   mean_e(me_e·ce_e)·E²  (k = 2),   mean_e(me_e·ce_e)·E²/k  (k > 2)

and :func:`full_batch_loss` sums them over MP before applying the formula.

Filled slots. Every DeepSpeed gate places the kept routes of an expert at locations from a cumulative sum
over the tokens of the *kept* mask (top-1 with or without RTS, top-2 with the second choices after the
first, top-k with either drop policy, and no-drop): the slots of expert e that hold a token are the
prefix 0..n_e-1 of its capacity. :func:`fill` returns fill_e = max live location + 1, which covers every
live slot even if a gate ever left a hole, so running an expert on its first fill_e slots is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.moe.sharded_moe import (
    TOPK_GATE_TIMER,
    TopKGate,
    _capacity,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)

from commweave import comm
from ds_plugins import collectives, moe_timers


@dataclass
class Routes:
    """Sparse routes of S tokens: ``indices`` [k, S] int32 (-1 = dropped), ``locations`` [k, S] int32,
    ``gates`` [k, S] fp32; ``capacity`` is the gate's C (the buffer may be padded beyond it)."""

    l_aux: torch.Tensor
    capacity: int
    indices: torch.Tensor
    locations: torch.Tensor
    gates: torch.Tensor
    exp_counts: torch.Tensor
    me: torch.Tensor
    ce: torch.Tensor


def _capacity_factor(gate: TopKGate) -> float:
    return gate.capacity_factor if gate.training else gate.eval_capacity_factor


def route(gate: TopKGate, x: torch.Tensor, used_token: torch.Tensor | None = None,
          weight: torch.Tensor | None = None) -> Routes:
    """Gate ``x`` [S, M]; ``weight`` replaces ``gate.wg.weight`` (S1 passes it through an MP copy). Timed by
    the gate's 'topk_gate' timer when the engine's ``wall_clock_breakdown`` is on (ds_plugins.moe_timers)."""
    with moe_timers.timed(gate, TOPK_GATE_TIMER):
        return _route(gate, x, used_token, weight)


def _route(gate: TopKGate, x: torch.Tensor, used_token: torch.Tensor | None,
           weight: torch.Tensor | None) -> Routes:
    x32 = x.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x32 = multiplicative_jitter(x32, device=x.device)
    logits = F.linear(x32, (gate.wg.weight if weight is None else weight).float())
    probs = F.softmax(logits, dim=1)  # before top2gating adds its Gumbel noise to logits in place
    cf, e = _capacity_factor(gate), logits.shape[1]
    if gate.k == 1:
        out = top1gating(logits, cf, gate.min_capacity, used_token,
                         gate.noisy_gate_policy if gate.training else None, gate.drop_tokens, gate.use_rts,
                         None, True, False)
    elif gate.k == 2:
        out = top2gating(logits, cf, gate.min_capacity, gate.drop_tokens, None, gate.top2_2nd_expert_sampling,
                         True)
    else:
        out = topkgating(logits, gate.k, cf, gate.min_capacity, gate.drop_tokens, None, sparse_routes=True)
    l_aux, capacity, _, indices, locations, gates, exp_counts = out
    if gate.k == 2:
        ce = F.one_hot(probs.argmax(dim=1), num_classes=e).float().mean(0)
    else:
        ce = exp_counts.float() / x.shape[0]
    return Routes(l_aux, int(capacity), indices, locations, gates, exp_counts, probs.mean(0), ce)


def fill(r: Routes, num_experts: int) -> torch.Tensor:
    """[E] int32: fill_e = 1 + the largest location of a live route to expert e (0 when none)."""
    live = r.indices >= 0
    out = torch.zeros(num_experts, dtype=torch.int32, device=r.indices.device)
    return out.scatter_reduce_(0, r.indices[live].long(), r.locations[live] + 1, reduce="amax")


def drop_capacity(gate: TopKGate, num_tokens: int) -> int:
    """The capacity DeepSpeed's gate gives ``num_tokens`` tokens in drop mode (``_capacity`` itself)."""
    k_factor = 1 if gate.k == 1 else gate.k
    shape = torch.empty((num_tokens, gate.wg.weight.shape[0]), device="meta")
    factor = torch.tensor(_capacity_factor(gate) * k_factor)
    return int(_capacity(shape, factor, torch.tensor(gate.min_capacity)))


def agree_capacity(capacity: int, groups_to_cover: list, device) -> int:
    """No-drop mode: the largest capacity over the ranks whose buffers meet (MAX over each group in turn)."""
    c = torch.tensor([capacity], dtype=torch.int64, device=device)
    for group in groups_to_cover:
        if group is not None:
            comm.all_reduce(c, group, op="max")
    return int(c.item())


def full_batch_loss(gate: TopKGate, r: Routes, num_local: int, num_total: int, mp_group):
    """S1: (l_aux, exp_counts) of all ``num_total`` tokens from each MP rank's ``num_local`` tokens.

    One all-reduce of [me·S_l, ce·S_l, counts] over MP; its dual is the identity (the loss is replicated on
    the MP ranks), so the gate-weight gradient stays a partial sum that S1 all-reduces (parm.md §2.7).
    """
    e = r.me.shape[0]
    stats = torch.cat([r.me * num_local, r.ce * num_local, r.exp_counts.to(r.me.dtype)])
    stats = collectives.reduce_from(stats, mp_group)
    me, ce = stats[:e] / num_total, stats[e: 2 * e] / num_total
    if gate.k == 1:
        l_aux = torch.sum(me * ce) * e
    else:
        l_aux = torch.mean(me * ce) * e * e / (1 if gate.k == 2 else gate.k)
    return l_aux, stats[2 * e:].detach().round().to(r.exp_counts.dtype)


def check_consistent(r: Routes, mp_group) -> None:
    """S2 debug check: routing must be bit-identical on the MP ranks (same RNG, same tie-breaks)."""
    if mp_group is None:
        return
    mine = torch.cat([r.indices.reshape(-1), r.locations.reshape(-1), r.gates.reshape(-1).view(torch.int32),
                      torch.tensor([r.capacity], dtype=torch.int32, device=r.indices.device)])
    every = mine.new_empty((comm.size(mp_group), mine.numel()))
    comm.all_gather(every, mine, mp_group)
    differ = [q for q in range(every.shape[0]) if not torch.equal(every[q], every[0])]
    if differ:
        raise RuntimeError(f"parm S2: routing differs across MP ranks (ranks {differ} of the MP group "
                           "disagree with rank 0): seed every MP rank's RNG identically before the MoE "
                           "layer, or use schedule 's1'")
