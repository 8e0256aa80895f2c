"""Team collectives: gather the team's rows sorted by chunk id, and reduce-scatter them back.

A rank's rows are two chunks ([s, ...] = [chunk lo; chunk hi] in the order layout.rank_chunks
gives). The team all-gather stacks the C members' rows; ``gather_team`` then reorders the 2C
chunks so that chunk ids ascend, which makes every causal block a prefix (layout.causal_calls).
``scatter_team`` undoes the order and reduce-scatters, so each member gets the sum of its rows.
Both pack several tensors into one collective (one latency term instead of three).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commweave import comm
from megatron_patches.groups import WallFacerGroups


def _perm(groups: WallFacerGroups) -> list[int] | None:
    """Chunk positions (all-gather order) in ascending chunk-id order; None when already sorted."""
    perm = groups.layout.sort_perm(groups.my_team)
    return None if perm == sorted(perm) else perm


def gather_team(groups: WallFacerGroups, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[s, b, h, d] per rank → [C·s, b, h, d] of the team, chunk ids ascending (copies)."""
    c = groups.layout.team_size
    if c == 1:
        return list(tensors)  # a rank's own two chunks already ascend (layout.rank_chunks)
    perm = _perm(groups)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = torch.empty((c, flat.numel()), dtype=flat.dtype, device=flat.device)
    comm.all_gather(gathered, flat, groups.team)
    member = torch.tensor([p // 2 for p in perm or range(2 * c)])
    part = torch.tensor([p % 2 for p in perm or range(2 * c)])
    out, off = [], 0
    for t in tensors:
        s, rest = t.shape[0], t.shape[1:]
        n = t.numel()
        rows = gathered[:, off:off + n].view(c, 2, s // 2, *rest)
        out.append(rows[member, part].view(c * s, *rest))
        off += n
    return out


def scatter_team(groups: WallFacerGroups, tensors: Sequence[torch.Tensor], dtype: torch.dtype
                 ) -> list[torch.Tensor]:
    """[C·s, ...] team rows (chunk ids ascending) → this rank's [s, ...] rows, summed over the team.

    Cast to ``dtype`` before the reduce-scatter: the wire carries the activation dtype (§5.1).
    """
    c = groups.layout.team_size
    if c == 1:
        return [t.to(dtype) for t in tensors]
    perm = _perm(groups)
    inv = None if perm is None else torch.tensor(sorted(range(len(perm)), key=perm.__getitem__))
    members = []
    for t in tensors:
        chunks = t.to(dtype).view(2 * c, t.shape[0] // (2 * c), *t.shape[1:])
        members.append(chunks if inv is None else chunks[inv])
    packed = torch.cat([m.reshape(c, -1) for m in members], dim=1)
    mine = torch.empty(packed.shape[1], dtype=dtype, device=packed.device)
    comm.reduce_scatter(mine, packed, groups.team)
    out, off = [], 0
    for t in tensors:
        shape = (t.shape[0] // c, *t.shape[1:])
        n = t.numel() // c
        out.append(mine[off:off + n].view(shape))
        off += n
    return out
