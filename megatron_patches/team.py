"""Team collectives: gather the team's rows sorted by stream position, and reduce-scatter them back.

A rank's rows are runs of stream positions (packing.py; dense zigzag: [chunk lo; chunk hi]). The team
all-gather stacks the C members' rows ("all-gather order", [C, s, ...]); ``gather_team`` then reorders
them so that positions ascend (rowmap.py), which makes every document's rows contiguous and every causal
block a prefix (rowmap.block_calls). In the zigzag layout no view does this (a member's hi chunk sits
after the others' in sorted order, its lo chunk before), so the reorder is a copy.

What is reduce-scattered (the output O, dQ, dK, dV) never needs sorted rows: those accumulators
are kept in all-gather order from the start (kernel results are added run by run,
rowmap.TeamRows.pieces), so ``reduce_team`` hands them to the reduce-scatter as they are, with no
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
from megatron_patches.rowmap import TeamRows


def _empty(key, shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def gather_team(groups: WallFacerGroups, rows: TeamRows, *stacks: Sequence[torch.Tensor], empty=_empty
                ) -> list[torch.Tensor]:
    """Each stack of L same-shaped [s, b, h, d] tensors → one [L, C·s, b, h, d] team tensor, rows sorted by
    stream position (``rows``: this rank's team, rowmap.team_rows). One all-gather for all of them.
    ``empty(key, shape, dtype, device)`` makes the buffers: key "wire" (dead on return) and the index of
    each stack's team tensor."""
    c = groups.layout.team_size
    if c == 1 and rows.identity:  # a rank's own rows already ascend (dense layouts, TE's THD order)
        return [torch.stack(list(ts)) if len(ts) > 1 else ts[0].unsqueeze(0) for ts in stacks]
    first = stacks[0][0]
    sizes = [len(ts) * ts[0].numel() for ts in stacks]
    wires = [None] * len(stacks)  # c = 1: rows to sort (the hybrid's Ulysses rows) but nothing to gather
    if c > 1:
        wire = empty("wire", (c, sum(sizes)), first.dtype, first.device)
        mine, off = wire[comm.rank(groups.team)], 0
        for ts in stacks:
            for t in ts:
                mine[off:off + t.numel()].view(t.shape).copy_(t)
                off += t.numel()
        comm.all_gather(wire, mine, groups.team)
        wires, off = [], 0
        for ts, n in zip(stacks, sizes, strict=True):
            wires.append(wire[:, off:off + n].view(c, len(ts), *ts[0].shape))
            off += n
    out = []
    for key, (ts, wire_l) in enumerate(zip(stacks, wires, strict=True)):
        team = empty(key, (len(ts), c * ts[0].shape[0], *ts[0].shape[1:]), first.dtype, first.device)
        for row, member, mrow, n in rows.copies:  # whole runs: strided copies at memcpy speed
            if wire_l is not None:
                team[:, row:row + n].copy_(wire_l[member, :, mrow:mrow + n])
            else:
                for i, t in enumerate(ts):
                    team[i, row:row + n].copy_(t[mrow:mrow + n])
        out.append(team)
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
