"""Team collectives: gather the team's rows sorted by chunk id, and reduce-scatter them back.

A rank's rows are two chunks ([s, ...] = [chunk lo; chunk hi] in the order layout.rank_chunks
gives). The team all-gather stacks the C members' rows; ``gather_team`` then reorders the 2C
chunks so that chunk ids ascend, which makes every causal block a prefix (layout.causal_calls).
``scatter_team`` undoes the order and reduce-scatters, so each member gets the sum of its rows.
Each packs all its tensors into one collective (one latency term instead of several) and moves
every element with one indexed copy between the wire buffer and the sorted team tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commweave import comm
from megatron_patches.groups import WallFacerGroups


def _order(groups: WallFacerGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(member, half) of the i-th smallest chunk of the team, as index tensors."""
    perm = groups.layout.sort_perm(groups.my_team)
    return torch.tensor([p // 2 for p in perm]), torch.tensor([p % 2 for p in perm])


def gather_team(groups: WallFacerGroups, *stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each stack of L same-shaped [s, b, h, d] tensors → one [L, C·s, b, h, d] team tensor, chunk
    ids ascending. One all-gather for all of them."""
    c = groups.layout.team_size
    if c == 1:  # a rank's own two chunks already ascend (layout.rank_chunks)
        return [torch.stack(list(ts)) if len(ts) > 1 else ts[0].unsqueeze(0) for ts in stacks]
    flat = torch.cat([t.reshape(-1) for ts in stacks for t in ts])
    gathered = torch.empty((c, flat.numel()), dtype=flat.dtype, device=flat.device)
    comm.all_gather(gathered, flat, groups.team)
    member, half = _order(groups)
    out, off = [], 0
    for ts in stacks:
        n, (s, *rest) = len(ts) * ts[0].numel(), ts[0].shape
        wire = gathered[:, off:off + n].view(c, len(ts), 2, -1)
        # team[l, i] = wire[member_i, l, half_i]: broadcasting indices, a single copy.
        team = wire[member[None, :], torch.arange(len(ts))[:, None], half[None, :]]
        out.append(team.view(len(ts), c * s, *rest))
        off += n
    return out


def scatter_team(groups: WallFacerGroups, tensors: Sequence[torch.Tensor], dtype: torch.dtype
                 ) -> list[torch.Tensor]:
    """[C·s, ...] team rows (chunk ids ascending) → this rank's [s, ...] rows, summed over the team.

    Cast to ``dtype`` on the way into the wire buffer: the reduce-scatter carries the activation
    dtype (§5.1).
    """
    c = groups.layout.team_size
    if c == 1:
        return [t.to(dtype) for t in tensors]
    member, half = _order(groups)
    sizes = [t.numel() // c for t in tensors]
    packed = torch.empty((c, sum(sizes)), dtype=dtype, device=tensors[0].device)
    off = 0
    for t, n in zip(tensors, sizes, strict=True):
        packed[:, off:off + n].view(c, 2, -1)[member, half] = t.reshape(2 * c, -1).to(dtype)
        off += n
    mine = torch.empty(packed.shape[1], dtype=dtype, device=packed.device)
    comm.reduce_scatter(mine, packed, groups.team)
    out, off = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        out.append(mine[off:off + n].view(t.shape[0] // c, *t.shape[1:]))
        off += n
    return out
