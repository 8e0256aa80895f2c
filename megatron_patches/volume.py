"""Bytes each rank puts on the wire in one WallFacer attention (wallfacer.md §5), per ledger key.

The keys are the ledger's ``(kind, group)`` with group one of ``"team"``, ``"ring"`` (the sub-ring
hops) and ``"cp"`` (the placement moves and the input check, over the caller's group); the
numbers are what :mod:`commweave.ledger` records for the implementation in wallfacer.py, so tests
assert equality, and the alpha-beta model of placement.py prices the same bytes.

Per rank, with A_q = s·b·h_q·d and A_kv = s·b·h_kv·d elements of one rank's shard, e the input
element size, e' the accumulator's (fp32, or fp64 for fp64 inputs), C the team size, G = P/C²:

forward
    checks (a checked call)            24 + 3 int64 to each other rank of the caller's group
                                       (checks.check_inputs, wallfacer.check_settings; also for U > 1)
    all-gather q, k, v in the team     (A_q + 2A_kv)(C−1)·e
    all-gather lse in the team         C·s·b·h_q·(C−1)·e'
    placement (paper Alg. 2)           2C·A_kv·e, unless the rank keeps its own team's K/V
    sub-ring hops                      (G−1)·2C·A_kv·e
    reduce-scatter O in the team       A_q(C−1)·e
backward, both variants
    all-gather dO and D in the team    (A_q·e + s·b·h_q·e')(C−1)   (D = rowsum(dO∘O), not O)
    reduce-scatter dq, dk, dv          (A_q + 2A_kv)(C−1)·e
backward, team Q/K/V rebuilt ("rebuild", paper §3.2.2) rather than kept from the forward
    all-gather q, k, v in the team     (A_q + 2A_kv)(C−1)·e, in the same all-gather as dO and D
    placement again                    2C·A_kv·e, unless the rank keeps its own team's K/V
backward, K/V circulating ("kv")
    sub-ring hops of k, v              (G−1)·2C·A_kv·e
    sub-ring hops of dk, dv            (G−1)·2C·A_kv·e'
    last dk, dv hop, fused with the inverse placement: 2C·A_kv·e' unless it stays on the rank
backward, queries circulating ("q", the paper's §3.2.1 variant)
    sub-ring hops of q, dO, lse, D     (G−1)·C·(2A_q·e + 2·s·b·h_q·e')
    sub-ring hops of dq                (G−1)·C·A_q·e', plus the hop home C·A_q·e' when G > 1
    inverse placement of dk, dv        2C·A_kv·e', unless the rank kept its own team's K/V

Ulysses x WallFacer (hybrid.py, U > 1), per rank, n = h_q/U query heads and n' = max(1, h_kv/U)
K/V heads per member, row = s·b·d:

forward
    all-to-all q, k, v to head shards  (U−1)·row·(n + 2n')·e      (group "ulysses")
    all-to-all O back                  (U−1)·row·n·e
    WallFacer over the P/U groups      the formulas above for U·s rows, n and n' heads, team size C,
                                       its placement moves over group "outer"
backward
    all-to-all dO, then dq, dk, dv     (U−1)·row·n·e + (U−1)·row·(n + 2n')·e
    WallFacer's backward over the P/U groups

C = 1 is ring attention (zigzag): (P−1)·2A_kv forward; (P−1)·2A_kv + P·2A_kv·e'/e backward, as in
ring-flash-attention. Counted the paper's way (every rank sends the placement, ring attention P
hops) the forward P2P is exactly 1/C of ring attention's: G·2C·A = (P/C)·2A. Measured, ranks that
keep their own K/V send nothing in the placement, so the mean per rank is at most that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megatron_patches.layout import Layout

META_BYTES = 24 * 8  # checks._FIELDS int64 per rank
SETTINGS_BYTES = (2 + 2) * 8  # wallfacer.check_settings: U, team_qkv, timeout, flag (comm.check_agree)


@dataclass(frozen=True)
class Shard:
    """One rank's shard: s_local rows, batch, heads, head dim, element sizes (input, accumulator)."""

    s: int
    b: int
    hq: int
    hkv: int
    d: int
    elt: int
    acc: int

    @property
    def a_q(self) -> int:
        return self.s * self.b * self.hq * self.d

    @property
    def a_kv(self) -> int:
        return self.s * self.b * self.hkv * self.d

    @property
    def rows(self) -> int:
        return self.s * self.b * self.hq


def forward_bytes(lay: Layout, sh: Shard, rank: int, checked: bool = True) -> Counter:
    """Bytes ``rank`` sends in the forward, keyed ``(kind, "team"|"ring"|"cp")``."""
    c, g, out = lay.team_size, lay.ring_len, Counter()
    if checked and lay.world > 1:
        out["all_gather", "cp"] += (META_BYTES + SETTINGS_BYTES) * (lay.world - 1)
    if c > 1:
        out["all_gather", "team"] += (sh.a_q + 2 * sh.a_kv) * (c - 1) * sh.elt    # q, k, v
        out["all_gather", "team"] += c * sh.rows * (c - 1) * sh.acc                # lse
        out["reduce_scatter", "team"] += sh.a_q * (c - 1) * sh.elt
    if lay.place_target(rank) != rank:
        out["send", "cp"] += 2 * c * sh.a_kv * sh.elt
    if g > 1:
        out["send", "ring"] += (g - 1) * 2 * c * sh.a_kv * sh.elt
    return +out


def backward_bytes(lay: Layout, sh: Shard, rank: int, mode: str, rebuild: bool = False) -> Counter:
    """Bytes ``rank`` sends in the backward of variant ``mode`` ("kv" or "q"); ``rebuild``: the team's
    Q/K/V are gathered and placed again rather than kept from the forward."""
    c, g, out = lay.team_size, lay.ring_len, Counter()
    if c > 1:
        out["all_gather", "team"] += (sh.a_q * sh.elt + sh.rows * sh.acc) * (c - 1)      # dO, D
        out["reduce_scatter", "team"] += (sh.a_q + 2 * sh.a_kv) * (c - 1) * sh.elt
        if rebuild:
            out["all_gather", "team"] += (sh.a_q + 2 * sh.a_kv) * (c - 1) * sh.elt       # q, k, v
    if rebuild and lay.place_target(rank) != rank:
        out["send", "cp"] += 2 * c * sh.a_kv * sh.elt
    if mode == "kv":
        out["send", "ring"] += (g - 1) * 2 * c * sh.a_kv * (sh.elt + sh.acc)
        if lay.place_source(lay.ring_next(rank)) != rank:
            out["send", "cp"] += 2 * c * sh.a_kv * sh.acc
    elif mode == "q":
        out["send", "ring"] += (g - 1) * c * (2 * sh.a_q * sh.elt + 2 * sh.rows * sh.acc + sh.a_q * sh.acc)
        if g > 1:
            out["send", "ring"] += c * sh.a_q * sh.acc
        if lay.place_source(rank) != rank:
            out["send", "cp"] += 2 * c * sh.a_kv * sh.acc
    else:
        raise ValueError(f"backward mode {mode!r} is not 'kv' or 'q'")
    return +out


def p2p_bytes(counts: Counter) -> int:
    return sum(n for (kind, _), n in counts.items() if kind == "send")


def mean_p2p(lay: Layout, sh: Shard, mode: str | None = None) -> float:
    """Mean over ranks of P2P bytes sent: forward (mode None) or the backward of ``mode``."""
    per_rank = [p2p_bytes(forward_bytes(lay, sh, r) if mode is None else backward_bytes(lay, sh, r, mode))
                for r in range(lay.world)]
    return sum(per_rank) / lay.world


def choose_backward(lay: Layout, sh: Shard) -> str:
    """The backward variant with fewer P2P bytes per rank; K/V circulation on a tie.

    Per hop, queries move 2·A_q·e + A_q·e' (+ lse and D) against K/V's 2·A_kv·(e + e'): with MHA the
    queries are lighter (8 vs 12 bytes per element in 16-bit, 12 vs 16 in fp32), with GQA ratio
    h_q/h_kv ≥ 2 the K/V.
    """
    if lay.ring_len == 1:
        return "kv"
    return "q" if mean_p2p(lay, sh, "q") < mean_p2p(lay, sh, "kv") else "kv"


def hybrid_bytes(world: int, u: int, lay: Layout, sh: Shard, rank: int, mode: str, rebuild: bool = False,
                 checked: bool = True) -> tuple[Counter, Counter]:
    """Forward and backward bytes CP rank ``rank`` sends in Ulysses x WallFacer with Ulysses size ``u``;
    ``lay`` is WallFacer's layout over the P/U groups, ``sh`` this rank's shard before the all-to-all.
    Keys as above, plus ``(kind, "ulysses")`` and ``"outer"`` for WallFacer's placement moves."""
    n, n_kv = sh.hq // u, max(1, sh.hkv // u)
    inner = Shard(u * sh.s, sh.b, n, n_kv, sh.d, sh.elt, sh.acc)
    row = (u - 1) * sh.s * sh.b * sh.d * sh.elt
    index = rank // u

    def outer(counts: Counter) -> Counter:
        return Counter({(kind, "outer" if grp == "cp" else grp): n for (kind, grp), n in counts.items()})

    fwd = outer(forward_bytes(lay, inner, index, checked=False))
    fwd["all_to_all", "ulysses"] += row * (n + 2 * n_kv) + row * n
    if checked:
        fwd["all_gather", "cp"] += (META_BYTES + SETTINGS_BYTES) * (world - 1)
    bwd = outer(backward_bytes(lay, inner, index, mode, rebuild))
    bwd["all_to_all", "ulysses"] += row * n + row * (n + 2 * n_kv)
    return +fwd, +bwd
