"""WallFacer's communication: team and sub-ring process groups, and the point-to-point moves.

The caller hands over one context-parallel group; the team groups (C ranks, all-gather and
reduce-scatter) and the sub-ring groups (G ranks, ring hops) are made lazily on the first call,
by their members only (``use_local_synchronization``), so no rank outside the CP group has to take
part and any number of CP groups can exist side by side. Two rules keep that safe:

- every rank of the CP group creates exactly one team group (if C > 1) and then one sub-ring group
  (if G > 1) per layout, the same sequence everywhere: torch names a locally synchronised group
  by its ranks *and the number of groups the process already has*, so members must have made the
  same number of groups before (a cache shared across layouts broke this);
- team before ring on every rank: a single global order for the overlapping creations;
- that number can repeat once groups are destroyed (Megatron's ``destroy_model_parallel`` destroys
  two), and a new group whose name a live group of the same ranks already has would fail:
  :func:`subgroup` moves the count on first (see there).

Groups are cached per (CP group, layout) and named for the ledger: ``wallfacer.team`` and
``wallfacer.ring``; the placement moves go over the CP group itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from commweave import comm
from megatron_patches.layout import Layout

TEAM, RING = "wallfacer.team", "wallfacer.ring"


def _name_taken(ranks: list[int]) -> bool:
    """Whether torch would give a members-only group of ``ranks`` made now the name of a live group
    (distributed_c10d._hash_ranks_to_str: the ranks and the number of groups this process holds)."""
    c10d = torch.distributed.distributed_c10d
    hash_ranks, world = getattr(c10d, "_hash_ranks_to_str", None), getattr(c10d, "_world", None)
    if hash_ranks is None or world is None:
        return False
    return hash_ranks(ranks) in world.pg_names.values()


def subgroup(global_ranks: Sequence[int], name: str):
    """A members-only process group of ``global_ranks``, ledger-named ``name``. Every member calls it.

    If its torch name is taken by a live group, that group has the same ranks and was made by these
    members together at the same group count, so every member sees the clash: each then makes a
    one-rank group of its own (no traffic), the same number of times, until the name is free.
    """
    ranks = sorted(global_ranks)
    me = torch.distributed.get_rank()
    while _name_taken(ranks):
        if _name_taken([me]):
            raise RuntimeError(f"cannot make a process group of ranks {ranks}: torch's names for it and "
                               f"for a one-rank group of rank {me} are both taken by live groups")
        comm.new_group([me], local_sync=True)
    return comm.new_group(ranks, name=name, local_sync=True)


@dataclass
class WallFacerGroups:
    """One rank's view: its CP group, the layout, and the team/sub-ring groups it belongs to; plus
    ``scratch``, the call-local CPU buffers steps.Run keeps between calls for this layout."""

    cp: object
    layout: Layout
    rank: int
    team: object | None
    ring: object | None
    _ring_rank: dict[int, int]
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def my_team(self) -> int:
        return self.layout.team_of(self.rank)

    def ring_shift(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], tag: int) -> list:
        """Post one sub-ring hop: each of ``sends`` to ring_next, each of ``recvs`` from ring_prev."""
        nxt = self._ring_rank[self.layout.ring_next(self.rank)]
        prv = self._ring_rank[self.layout.ring_prev(self.rank)]
        ops = [comm.P2P("send", t, nxt, self.ring, tag) for t in sends]
        ops += [comm.P2P("recv", t, prv, self.ring, tag) for t in recvs]
        return comm.batch_p2p(ops)

    def permute(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int) -> list:
        """Send ``send`` to CP rank ``dst`` while receiving ``recv`` from ``src`` (self: a copy)."""
        if dst == self.rank:
            if src != self.rank:
                raise RuntimeError(f"rank {self.rank} keeps its buffer but expects one from {src}")
            recv.copy_(send)
            return []
        return comm.batch_p2p([comm.P2P("send", send, dst, self.cp, tag),
                               comm.P2P("recv", recv, src, self.cp, tag)])


_cache: dict[tuple, WallFacerGroups] = {}


def wallfacer_groups(cp_group, layout: Layout) -> WallFacerGroups:
    """The (cached) groups of this rank for ``layout`` over ``cp_group``. Members-only, lazy.

    The cache holds the CP group object, so its id cannot be reused by another group while cached.
    """
    key = (id(cp_group), layout)
    if key in _cache:
        return _cache[key]
    cp_ranks = tuple(comm.global_rank(cp_group, r) for r in range(layout.world))
    me = comm.rank(cp_group)
    team = ring = None
    if layout.team_size > 1:
        members = layout.team_ranks(layout.team_of(me))
        team = subgroup([cp_ranks[r] for r in members], TEAM)
        # The all-gather stacks members in team-group rank order; layout.team_ranks promises it.
        want = [cp_ranks[r] for r in members]
        got = [comm.global_rank(team, i) for i in range(layout.team_size)]
        if got != want:
            raise RuntimeError(f"team group orders its ranks {got}, expected {want}")
    ring_rank: dict[int, int] = {}
    if layout.ring_len > 1:
        ring_members = layout.ring_ranks(me)
        ring = subgroup([cp_ranks[r] for r in ring_members], RING)
        by_global = {comm.global_rank(ring, i): i for i in range(layout.ring_len)}
        ring_rank = {r: by_global[cp_ranks[r]] for r in ring_members}
    groups = WallFacerGroups(cp_group, layout, me, team, ring, ring_rank)
    _cache[key] = groups
    return groups


def cached_groups() -> list[WallFacerGroups]:
    """Every WallFacerGroups this process made (one per CP group and layout)."""
    return list(_cache.values())
