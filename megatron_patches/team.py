"""Team collectives: gather the team's rows sorted by chunk id, and reduce-scatter them back.

A rank's rows are two chunks ([s, ...] = [chunk lo; chunk hi] in the order layout.rank_chunks
gives). The team all-gather stacks the C members' rows ("all-gather order", [C, s, ...]);
``gather_team`` then reorders the 2C chunks so that chunk ids ascend, which makes every causal
block a prefix (layout.causal_calls). In the zigzag layout no view does this (a member's hi chunk
sits after the others' in sorted order, its lo chunk before), so the reorder is a copy.

What is reduce-scattered (the output O, dQ, dK, dV) never needs sorted rows: those accumulators
are kept in all-gather order from the start (kernel results are added run by run,
layout.wire_runs), so ``reduce_team`` hands them to the reduce-scatter as they are, with no
packing copy and no extra buffer.

Copies are what the team costs a CPU rank beyond the bytes on the wire, so the gather copies each
element once on each side: this rank's tensors go straight into its slot of the wire buffer (the
all-gather's copy of its own input onto that slot is then a no-op: ATen's ``copy_`` returns early
when source and destination are the same memory), and the reorder is whole-chunk strided copies
(memcpy speed; an advanced-indexing gather runs about 4x slower).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commweave import comm
from megatron_patches.groups import WallFacerGroups


def _empty(key, shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def gather_team(groups: WallFacerGroups, *stacks: Sequence[torch.Tensor], empty=_empty) -> list[torch.Tensor]:
    """Each stack of L same-shaped [s, b, h, d] tensors → one [L, C·s, b, h, d] team tensor, chunk
    ids ascending. One all-gather for all of them. ``empty(key, shape, dtype, device)`` makes the
    buffers: key "wire" (dead on return) and the index of each stack's team tensor."""
    c = groups.layout.team_size
    if c == 1:  # a rank's own two chunks already ascend (layout.rank_chunks)
        return [torch.stack(list(ts)) if len(ts) > 1 else ts[0].unsqueeze(0) for ts in stacks]
    first = stacks[0][0]
    sizes = [len(ts) * ts[0].numel() for ts in stacks]
    wire = empty("wire", (c, sum(sizes)), first.dtype, first.device)
    mine, off = wire[comm.rank(groups.team)], 0
    for ts in stacks:
        for t in ts:
            mine[off:off + t.numel()].view(t.shape).copy_(t)
            off += t.numel()
    comm.all_gather(wire, mine, groups.team)
    perm = groups.layout.sort_perm(groups.my_team)
    out, off = [], 0
    for key, (ts, n) in enumerate(zip(stacks, sizes, strict=True)):
        s, rest = ts[0].shape[0], ts[0].shape[1:]
        wire_l = wire[:, off:off + n].view(c, len(ts), 2, s // 2, -1)  # [member, l, half, rows, ·]
        team = empty(key, (len(ts), 2 * c, s // 2, wire_l.shape[-1]), wire.dtype, wire.device)
        for i, p in enumerate(perm):
            team[:, i].copy_(wire_l[p // 2, :, p % 2])
        out.append(team.view(len(ts), c * s, *rest))
        off += n
    return out


def reduce_team(groups: WallFacerGroups, tensors: Sequence[torch.Tensor], dtype: torch.dtype
                ) -> list[torch.Tensor]:
    """[C, ...] team tensors in all-gather order (member-major) → this rank's [...], summed over the
    team. One reduce-scatter per tensor, in ``dtype``: the wire carries the activation dtype (§5.1),
    so 32-bit accumulators of 16-bit activations are cast first. The results never alias the inputs
    (which may be reused buffers): with C = 1 they are copies."""
    c, out = groups.layout.team_size, []
    for t in tensors:
        if c == 1:
            out.append(t[0].to(dtype, copy=True))
            continue
        wire = t.to(dtype)
        mine = torch.empty(t.shape[1:], dtype=dtype, device=t.device)
        comm.reduce_scatter(mine, wire, groups.team)
        out.append(mine)
    return out
