"""WallFacer's rank arithmetic: teams, sub-rings, the initial K/V placement and the zigzag chunks.

Pure integer maths, no tensors and no communication (wallfacer.md §1, §2, §6).

Coordinates. P ranks of the context-parallel group sit in P logical *slots*; ``order[slot]`` is the
group rank placed in that slot (identity for the contiguous placement, a node-aware permutation
otherwise, see placement.py). With team size C:

- slot g = r_t·C + r_a: team r_t (C consecutive slots), intra-team rank r_a;
- T = P/C teams, grouped into C *team groups* of G = P/C² adjacent teams;
- a *sub-ring* is the G slots of one team group that share r_a: C² sub-rings of length G.

Ring neighbours are paper Alg. 3 (``get_P2P_config``), the initial K/V placement is paper Alg. 2
(``get_init_send``); after it, slot (T′, a′) holds the K/V of team (T′ mod G)·C + a′, so the G
slots of a sub-ring hold the K/V of G distinct teams and the C sub-rings a team's members sit in
cover all T teams exactly once (checked for every valid (P, C) up to 256 in the tests).

Tokens. A dense sequence is cut into 2P equal chunks. In the zigzag layout (Megatron's
``get_batch_on_this_cp_rank``) group rank r holds chunks r and 2P−1−r, which balances causal work;
in the contiguous layout it holds chunks 2r and 2r+1. Packed documents, and which rows a team's calls
pair (the causal rule per document): packing.py and rowmap.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAYOUTS = ("zigzag", "contiguous")


def valid_team_sizes(world: int) -> list[int]:
    """The team sizes C allowed for P ranks: C² divides P (so 1 ≤ C ≤ √P)."""
    return [c for c in range(1, world + 1) if c * c <= world and world % (c * c) == 0]


def team_size_error(world: int, team_size: int) -> str | None:
    """Why ``team_size`` is invalid for ``world`` ranks, or None."""
    if world < 1:
        return f"the context-parallel group must have >= 1 rank, got P={world}"
    if team_size < 1 or world % (team_size * team_size):
        return (f"team_size C={team_size} is invalid for P={world} ranks: C² must divide P "
                f"(valid: {', '.join(map(str, valid_team_sizes(world)))})")
    return None


def rank_chunks(layout: str, world: int, rank: int) -> tuple[int, int]:
    """The two chunk ids (of 2P) group rank ``rank`` holds, in the order its rows hold them."""
    if layout == "zigzag":
        return rank, 2 * world - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


@dataclass(frozen=True)
class Layout:
    """Teams, rings and placement of one WallFacer group of ``world`` ranks with ``team_size`` C."""

    world: int
    team_size: int
    order: tuple[int, ...] = ()
    layout: str = "zigzag"
    _slot_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        error = team_size_error(self.world, self.team_size)
        if error:
            raise ValueError(error)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {LAYOUTS}")
        order = tuple(self.order) or tuple(range(self.world))
        if sorted(order) != list(range(self.world)):
            raise ValueError(f"order must be a permutation of range({self.world}), got {list(order)}")
        object.__setattr__(self, "order", order)
        slot_of = [0] * self.world
        for slot, r in enumerate(order):
            slot_of[r] = slot
        object.__setattr__(self, "_slot_of", tuple(slot_of))

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def teams(self) -> int:
        """T = P/C."""
        return self.world // self.team_size

    @property
    def ring_len(self) -> int:
        """G = P/C²: the sub-ring length, i.e. the number of ring steps."""
        return self.world // (self.team_size * self.team_size)

    # -- slots and coordinates -----------------------------------------------------------------------
    def slot(self, rank: int) -> int:
        return self._slot_of[rank]

    def coords(self, slot: int) -> tuple[int, int]:
        """(r_t, r_a) of a slot."""
        return divmod(slot, self.team_size)

    def team_of(self, rank: int) -> int:
        return self.slot(rank) // self.team_size

    def team_ranks(self, team: int) -> list[int]:
        """Group ranks of a team, ascending: the order in which the team all-gather stacks them."""
        c = self.team_size
        return sorted(self.order[team * c:(team + 1) * c])

    def _ring_team(self, team: int, shift: int) -> int:
        g = self.ring_len
        return (team + shift) % g + g * (team // g)

    def ring_next(self, rank: int) -> int:
        """Paper Alg. 3: next_rank = r_a + next_team·C, next_team = (r_t+1) mod G + G·(r_t div G)."""
        r_t, r_a = self.coords(self.slot(rank))
        return self.order[self._ring_team(r_t, 1) * self.team_size + r_a]

    def ring_prev(self, rank: int) -> int:
        r_t, r_a = self.coords(self.slot(rank))
        return self.order[self._ring_team(r_t, -1) * self.team_size + r_a]

    def ring_ranks(self, rank: int) -> list[int]:
        """Group ranks of ``rank``'s sub-ring, in ring order starting at the team group's first team."""
        r_t, r_a = self.coords(self.slot(rank))
        first = r_t - r_t % self.ring_len
        return [self.order[(first + i) * self.team_size + r_a] for i in range(self.ring_len)]

    # -- initial K/V placement -----------------------------------------------------------------------
    def place_target(self, rank: int) -> int:
        """Paper Alg. 2: target_team = r_a·G + r_t div C, target intra rank = r_t mod C."""
        r_t, r_a = self.coords(self.slot(rank))
        c = self.team_size
        return self.order[(r_a * self.ring_len + r_t // c) * c + r_t % c]

    def place_source(self, rank: int) -> int:
        """Inverse of Alg. 2: slot (T′, a′) receives from r_t = (T′ mod G)·C + a′, r_a = T′ div G."""
        t2, a2 = self.coords(self.slot(rank))
        g, c = self.ring_len, self.team_size
        return self.order[((t2 % g) * c + a2) * c + t2 // g]

    def kv_team(self, rank: int, step: int = 0) -> int:
        """Team whose K/V ``rank`` holds at ring step ``step`` (0 = right after the placement).

        K/V move to ring_next each step, so at step i a rank holds what its i-th predecessor placed.
        """
        t2, a2 = self.coords(self.slot(rank))
        holder_team = self._ring_team(t2, -step)
        return (holder_team % self.ring_len) * self.team_size + a2

    def q_team_at(self, rank: int, step: int) -> int:
        """Team whose queries visit ``rank`` at step ``step`` of the query-circulating backward."""
        return self._ring_team(self.team_of(rank), -step)
