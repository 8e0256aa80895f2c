"""Routing with DeepSpeed's own gate, minus its hidden collective, for every schedule (parm.md §2.8).

:func:`route` is ``TopKGate.forward`` step for step (fp32 logits, 'Jitter' on the input, top-1 / top-2 /
top-k gating from ``deepspeed.moe.sharded_moe``), called with ``ep_group=None`` so that the no-drop
capacity all-reduce is not issued behind our back: the schedules agree on every size themselves, over
every group their collectives use (ds_plugins.agreement). It draws random numbers exactly as the gate
does, so S2 and "deepspeed" route bit-identically to DeepSpeed's MoE from the same RNG state.

S1 (:func:`route_shard`) gates the *whole* batch on every MP rank, as DeepSpeed's gate and S2 do: the gate
GEMM on all S tokens (the MoE input is replicated over MP; the GEMM is S·M·E flops, small beside the
experts' k·f·S·M·H·4), the same DeepSpeed gating function, then it keeps its block's routes. So the MP ranks
hold bit-identical full-batch routes with no exchange (their route hash rides on the fill counts' headers,
ds_plugins.agreement), S1 keeps and drops exactly the routes DeepSpeed's gate keeps and drops (capacity,
RTS, Gumbel sampling, 'probs' drop policy alike), its l_aux and exp_counts are the full batch's, and every
MP rank draws the full batch's random numbers (the 'Jitter' noise [S, M] included): their RNG streams stay
identical whatever S % N is. Only the rows of its own block are differentiated on a rank (:class:`_Block`):
each MP rank's combine covers its block's routes, so its gradient of those rows is complete (the combine's
part and the l_aux part) and the others' are their ranks'. An earlier S1 ran the GEMM on its block and
all-gathered the logits [S, E] over MP: a collective sized by S before the fill exchange, which kept S1
and "auto" with MP from the sync-free forward (issue 23).

The block's kept routes are renumbered per expert from slot 0 in DeepSpeed's slot order (:func:`shard`),
so its buffer needs only the largest number of routes one block sends one expert, about C/N, not C.

Filled slots. Every DeepSpeed gate places the kept routes of an expert at locations from a cumulative sum
over the tokens of the *kept* mask (top-1 with or without RTS, top-2 with the second choices after the
first, top-k with either drop policy, and no-drop), and :func:`shard` renumbers from 0: the slots of
expert e that hold a token are the prefix 0..n_e-1 of its capacity. :func:`fill` returns
fill_e = max live location + 1, which covers every live slot even if a gate ever left a hole, so running
an expert on its first fill_e slots is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.moe.sharded_moe import (
    TOPK_GATE_TIMER,
    TopKGate,
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
    ``gates`` [k, S] fp32; ``capacity`` is the gate's C (the buffer may be padded beyond it): an int with
    token dropping, without it the gate's 0-d tensor (the routes' largest expert count, not read)."""

    l_aux: torch.Tensor
    capacity: int | torch.Tensor
    indices: torch.Tensor
    locations: torch.Tensor
    gates: torch.Tensor
    exp_counts: torch.Tensor


def _capacity_factor(gate: TopKGate) -> float:
    return gate.capacity_factor if gate.training else gate.eval_capacity_factor


def gating(gate: TopKGate, logits: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
    """DeepSpeed's top-1 / top-2 / top-k gating of ``logits`` [S, E] (fp32), as ``TopKGate.forward`` does."""
    cf = _capacity_factor(gate)
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
    # Under bf16/fp16 autocast the gate GEMM and its softmax run in the low precision and the gates come
    # out in it; they are widened here, once, so that the combine weights and sums each token's routes in
    # fp32 as DeepSpeed's _sparse_decode intends ("gates is fp32, so the product and the sum over routes
    # accumulate in fp32"), and the MP routing check compares fp32 words. The gates' values are the gate's,
    # and their gradient flows back through the cast to the gate in its own dtype.
    if gates.dtype in (torch.bfloat16, torch.float16):
        gates = gates.float()
    return Routes(l_aux, _capacity(gate, capacity, logits.shape, cf), indices, locations, gates, exp_counts)


_DROP_CAPACITY: dict[tuple, int] = {}


def _capacity(gate: TopKGate, capacity, logits_shape, cf: float) -> int | torch.Tensor:
    """The gate's capacity. With token dropping DeepSpeed computes it from the shape, k, the capacity
    factor and min_capacity alone (``_capacity``, a CPU tensor), so it is read once per such key and
    remembered as an int: a steady-state forward reads no tensor for it. Without dropping it is the routes'
    (the largest expert count), returned as the gate's 0-d tensor, unread: the schedules agree on it over
    the layer, on the fill counts' headers where they can (ds_plugins.schedules)."""
    if not gate.drop_tokens:
        return capacity if isinstance(capacity, torch.Tensor) else torch.tensor(capacity)
    key = (gate.k, *logits_shape, cf, gate.min_capacity)
    if key not in _DROP_CAPACITY:
        _DROP_CAPACITY[key] = int(capacity)
    return _DROP_CAPACITY[key]


def _noise(gate: TopKGate, x: torch.Tensor) -> torch.Tensor | None:
    """'Jitter' in training: the full batch's multiplicative noise [S, M], drawn as DeepSpeed draws it."""
    if gate.noisy_gate_policy != "Jitter" or not gate.training:
        return None
    return multiplicative_jitter(torch.ones(x.shape, device=x.device), device=x.device)


def route(gate: TopKGate, x: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
    """Gate all S tokens of ``x`` [S, M]. Timed by the gate's 'topk_gate' timer when the engine's
    ``wall_clock_breakdown`` is on (ds_plugins.moe_timers), as :func:`route_shard` is."""
    with moe_timers.timed(gate, TOPK_GATE_TIMER):
        x32, noise = x.float(), _noise(gate, x)
        x32 = x32 if noise is None else x32 * noise
        return gating(gate, F.linear(x32, gate.wg.weight.float()), used_token)


class _Block(torch.autograd.Function):
    """``F.linear(x32, weight)``: the logits [S, E] of every token from the GEMM DeepSpeed's gate runs (so
    the MP ranks' logits are bit-identical), differentiated through rows [lo, lo + S_q) only, into this
    rank's block ``x32_l`` (those rows of ``x32``, with the graph) and the weight (a partial sum over the
    blocks: ``weight`` comes through an MP copy, all-reduced in the backward, parm.md §2.7).

    The backward GEMMs run in the forward's dtype, as autocast's would (bf16 logits: bf16 products, the
    gradients cast back to the inputs' fp32)."""

    @staticmethod
    def forward(ctx, x32_l, weight, x32, lo: int):
        ctx.save_for_backward(x32_l, weight)
        ctx.lo = lo
        return F.linear(x32, weight)

    @staticmethod
    def backward(ctx, grad):
        x32_l, weight = ctx.saved_tensors
        g = grad[ctx.lo: ctx.lo + x32_l.shape[0]]
        return ((g @ weight.to(g.dtype)).to(x32_l.dtype), (g.t() @ x32_l.to(g.dtype)).to(weight.dtype),
                None, None)


def route_shard(gate: TopKGate, x: torch.Tensor, x_l: torch.Tensor, used_token: torch.Tensor | None,
                mp_group, mp_rank: int, mp_size: int) -> tuple[Routes, torch.Tensor, Routes]:
    """S1: gate the S tokens of ``x`` [S, M] (replicated over MP), of which this MP rank holds the block
    ``x_l`` (``torch.tensor_split`` order, with the graph to ``x``): no collective.

    Returns this block's routes (locations renumbered, see :func:`shard`), the largest number of routes
    any block sends one expert (the same on every MP rank), a 0-d int64 tensor on the device that S1
    agrees on without reading it (it rides on the fill counts' headers, ds_plugins.schedules.s1), and the
    full-batch routes the MP ranks share (hashed into the headers).
    """
    with moe_timers.timed(gate, TOPK_GATE_TIMER):
        lo = sum(collectives.row_blocks(x.shape[0], mp_size)[:mp_rank])
        x32, x32_l, noise = x.detach().float(), x_l.float(), _noise(gate, x)
        if noise is not None:
            x32, x32_l = x32 * noise, x32_l * noise[lo: lo + x_l.shape[0]]
        weight = collectives.copy_to(gate.wg.weight.float(), mp_group)
        full = gating(gate, _Block.apply(x32_l, weight, x32, lo), used_token)
        mine, most = _shard(full, mp_rank, mp_size)
        return mine, most, full


def shard(r: Routes, q: int, n: int) -> tuple[Routes, int]:
    """Block q of n of full-batch routes: its live routes to each expert renumbered 0, 1, ... in their
    slot order; and the largest number of live routes one block sends one expert (its capacity)."""
    mine, most = _shard(r, q, n)
    return mine, int(most)


def _shard(r: Routes, q: int, n: int) -> tuple[Routes, torch.Tensor]:
    """:func:`shard` with the capacity a 0-d int64 tensor on the routes' device (not read)."""
    k, tokens = r.indices.shape
    e = r.exp_counts.shape[0]
    sizes = collectives.row_blocks(tokens, n)
    block = torch.repeat_interleave(torch.arange(n, device=r.indices.device),
                                    torch.tensor(sizes, device=r.indices.device))
    live = r.indices >= 0
    key = (block.expand(k, tokens) * e + r.indices.long())[live]              # (block, expert) per route
    order = torch.argsort(key * (k * tokens) + r.locations[live].long())      # locations < k·S
    counts = torch.bincount(key, minlength=n * e)
    starts = counts.cumsum(0) - counts
    renumbered = torch.empty_like(key)
    renumbered[order] = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    locations = torch.zeros_like(r.locations)
    locations[live] = renumbered.to(locations.dtype)
    lo = sum(sizes[:q])
    cols = slice(lo, lo + sizes[q])
    mine = Routes(r.l_aux, r.capacity, r.indices[:, cols].contiguous(), locations[:, cols].contiguous(),
                  r.gates[:, cols].contiguous(), r.exp_counts)
    return mine, counts.max().clamp(min=1)


def fill(r: Routes, num_experts: int) -> torch.Tensor:
    """[E] int32: fill_e = 1 + the largest location of a live route to expert e (0 when none)."""
    live = r.indices >= 0
    out = torch.zeros(num_experts, dtype=torch.int32, device=r.indices.device)
    return out.scatter_reduce_(0, r.indices[live].long(), r.locations[live] + 1, reduce="amax")


def check_consistent(r: Routes, mp_group) -> None:
    """S2 debug check: routing must be bit-identical on the MP ranks (same RNG, same tie-breaks)."""
    if mp_group is None:
        return
    mine = torch.cat([r.indices.reshape(-1), r.locations.reshape(-1), r.gates.reshape(-1).view(torch.int32),
                      torch.as_tensor(r.capacity).to(r.indices.device, torch.int32).reshape(1)])
    every = mine.new_empty((comm.size(mp_group), mine.numel()))
    comm.all_gather(every, mine, mp_group)
    differ = [q for q in range(every.shape[0]) if not torch.equal(every[q], every[0])]
    if differ:
        raise RuntimeError(f"parm S2: routing differs across MP ranks (ranks {differ} of the MP group "
                           "disagree with rank 0): seed every MP rank's RNG identically before the MoE "
                           "layer")
