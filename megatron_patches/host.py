"""Host work: what one WallFacer forward + backward costs besides its kernels and its bytes, measured on
the code path itself at a size where kernels and bytes are negligible.

The cost model (placement.estimate, choice.plan_s) prices kernel calls by their work (the attention
curves) and messages by their bytes (links, collectives). A call also runs code whose time depends on
its *structure*, not on its sizes: Python and autograd (the two autograd functions, the hybrid's four
head-reordering ones), per ring step the posting and waiting of messages, the row bookkeeping
(rowmap pieces), per kernel call the merge's and accumulations' small tensor ops and their dispatch,
per collective the comm module's checks and tracing. None of the microbenchmarks sees that work: each
times one kernel call or one message.

Measurement (calibrate.py, ``--host-rows``): every plan (U, C, slot order) auto chooses among for the
calibrated world (choice.candidates) runs ``wallfacer_attention`` forward + backward on HOST rows per
rank (MHA, the largest --heads, --head-dim, the profile's dtype; check=False, as every dense call after
the first), all plans interleaved, on all ranks at once, in the profile's clock. With 16 rows per rank
the kernels and messages are of the sizes the microbenchmarks price at their smallest, so

    host(U, C, order) = t_tiny(U, C, order) − model_tiny(U, C, order)

where model_tiny is the model's own price of that tiny problem (choice.plan_s with the profile before
host work is added: the α of every message and the curves' smallest-block throughput for the kernels),
clamped at 0. The structure (how many kernel calls, steps, messages and autograd nodes) is the same at
every sequence length for a dense batch, so the model adds host(U, C, order) to its price at any length
(Profile.host_s). What this leaves out, and says: work that grows with the sizes outside the kernels and
messages (zeroing accumulators, the gathers' row sorting, dtype casts: memory traffic), and a kernel
call's fixed cost, which the curves' measured blocks (128 rows and up) also hold, is counted twice; that
share is not separated here (it is at most the host value itself: 2-16 ms per plan at P = 8 on this
machine, README).
"""

from __future__ import annotations

import torch

HOST_ROWS = 16


def plan_key(world: int, u: int, c: int, order: str) -> str:
    """The profile's key of a plan's host seconds: "P U C order"."""
    return f"{world} {u} {c} {order}"


def plan_steps(s: int, b: int, h: int, d: int, plans, dtype=torch.float32, device="cpu") -> dict:
    """On every rank of the default group: one closure per plan (U, C, order) running causal
    wallfacer_attention forward + backward on this rank's zigzag rows of a random [P·s, b, h, d] MHA
    problem (the same on every rank: seed 0), check=False; each run once (groups and first-call
    buffers outside any timing). Keyed by plan_key."""
    import torch.distributed as dist

    from megatron_patches.layout import rank_chunks
    from megatron_patches.placement import ORDERS
    from megatron_patches.wallfacer import wallfacer_attention

    world, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    half = s // 2
    rows = torch.cat([torch.arange(c * half, (c + 1) * half) for c in rank_chunks("zigzag", world, me)])
    q, k, v, g = (torch.randn(world * s, b, h, d, generator=gen, dtype=dtype)[rows].to(device)
                  for _ in range(4))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = {}
    for u, c, order in plans:
        perm = ORDERS[order](world // u, c)

        def step(u=u, c=c, perm=perm):
            wallfacer_attention(*ins, dist.group.WORLD, c, ulysses_size=u, order=perm,
                                check=False).backward(g)
        step()
        out[plan_key(world, u, c, order)] = step
    return out


def host_plans(world: int, heads: int, head_dim: int, elt: int, acc: int) -> list[tuple[int, int, str]]:
    """The plans whose host work a calibration of ``world`` ranks measures: every candidate of one node."""
    from megatron_patches.choice import candidates
    from megatron_patches.volume import Shard

    return candidates(world, Shard(HOST_ROWS, 1, heads, heads, head_dim, elt, acc), [0] * world)


def host_table(tiny: dict, world: int, heads: int, head_dim: int, elt: int, acc: int, prof) -> dict:
    """{plan_key: host seconds}: each plan's measured tiny seconds (``tiny``, in ``prof``'s clock) less the
    model's price of the same tiny problem under ``prof`` (a profile without host work), at least 0."""
    from megatron_patches.choice import plan_s
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    topo = Topology.from_profile(prof, world)
    sh = Shard(HOST_ROWS, 1, heads, heads, head_dim, elt, acc)
    out = {}
    for u, c, order in host_plans(world, heads, head_dim, elt, acc):
        key = plan_key(world, u, c, order)
        out[key] = max(0.0, tiny[key] - plan_s(world, sh, [0] * world, topo, u, c, order))
    return out
