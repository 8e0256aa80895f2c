"""Rank arithmetic of WallFacer, checked exhaustively in one process (rank-count independent)."""

import random

import pytest

from megatron_patches import packing
from megatron_patches.layout import Layout, rank_chunks, team_size_error, valid_team_sizes
from megatron_patches.placement import ring_major
from megatron_patches.rowmap import rank_scores

WORLDS = [1, 2, 4, 8, 9, 16, 18, 27, 32, 36, 64, 72, 128, 256]


def _layouts():
    for p in WORLDS:
        for c in valid_team_sizes(p):
            perm = list(range(p))
            random.Random(p * 31 + c).shuffle(perm)
            for order in ((), ring_major(p, c), tuple(perm)):
                yield Layout(p, c, order)


def test_valid_team_sizes():
    assert valid_team_sizes(8) == [1, 2]
    assert valid_team_sizes(16) == [1, 2, 4]
    assert valid_team_sizes(64) == [1, 2, 4, 8]
    assert valid_team_sizes(18) == [1, 3]
    assert team_size_error(8, 4) == "team_size C=4 is invalid for P=8 ranks: C² must divide P (valid: 1, 2)"
    assert team_size_error(16, 4) is None
    with pytest.raises(ValueError, match="C=3 is invalid for P=8"):
        Layout(8, 3)
    with pytest.raises(ValueError, match="order must be a permutation"):
        Layout(4, 1, (0, 1, 1, 2))


def test_placement_is_a_permutation_and_source_inverts_it():
    for lay in _layouts():
        targets = [lay.place_target(r) for r in range(lay.world)]
        assert sorted(targets) == list(range(lay.world))
        assert all(lay.place_source(t) == r for r, t in enumerate(targets))


def test_sub_rings_cover_every_team_once_per_team():
    """After placement, the C members of a team together meet every team's K/V exactly once (§2)."""
    for lay in _layouts():
        for team in range(lay.teams):
            seen = [lay.kv_team(r, i) for r in lay.team_ranks(team) for i in range(lay.ring_len)]
            assert sorted(seen) == list(range(lay.teams)), (lay, team)


def test_ring_neighbours_and_moving_kv():
    for lay in _layouts():
        for r in range(lay.world):
            nxt = lay.ring_next(r)
            assert lay.ring_prev(nxt) == r
            assert set(lay.ring_ranks(r)) == set(lay.ring_ranks(nxt)) and r in lay.ring_ranks(r)
            assert len(lay.ring_ranks(r)) == lay.ring_len
            # K/V move to ring_next each step; queries (q backward) too.
            for i in range(lay.ring_len):
                assert lay.kv_team(nxt, i + 1) == lay.kv_team(r, i)
                assert lay.q_team_at(nxt, i + 1) == lay.q_team_at(r, i)
            # The K/V placed here come from the team that placed them (Alg. 2).
            assert lay.kv_team(r, 0) == lay.team_of(lay.place_source(r))


def test_worked_example_p8_c2():
    """wallfacer.md §2 table: GPU → KV team after the placement, and the four sub-rings."""
    lay = Layout(8, 2)
    assert [lay.kv_team(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {tuple(sorted(lay.ring_ranks(r))) for r in range(8)} == {(0, 2), (1, 3), (4, 6), (5, 7)}
    # Alg. 2 by hand: GPU 2 = (r_t 1, r_a 0) → team 0·G + 1 div 2 = 0, intra 1 mod 2 = 1 → GPU 1.
    assert [lay.place_target(r) for r in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]


def test_c1_is_ring_attention_and_c_sqrt_p_has_no_ring():
    ring = Layout(8, 1)
    assert [ring.ring_next(r) for r in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]
    assert all(ring.place_target(r) == r for r in range(8))
    star = Layout(16, 4)
    assert star.ring_len == 1 and all(star.ring_next(r) == r for r in range(16))
    # C = √P: the placement is the transpose (r_t, r_a) → (r_a, r_t).
    assert all(star.place_target(t * 4 + a) == a * 4 + t for t in range(4) for a in range(4))


def _work(lay: Layout, rank: int, chunk: int) -> int:
    """Unmasked score entries ``rank`` computes in the whole forward (chunk = tokens per chunk)."""
    return rank_scores(packing.shards(packing.dense(2 * lay.world * chunk), lay.layout, lay.world), lay)[rank]


def test_zigzag_balances_causal_work():
    """wallfacer.md §6 table (4 tokens per chunk): min–max unmasked scores per rank, zigzag vs contiguous."""
    for (p, c), (lo, hi) in {(8, 2): (256, 264), (16, 4): (512, 528), (16, 2): (512, 520)}.items():
        n = 8 * p
        work = [_work(Layout(p, c), r, 4) for r in range(p)]
        assert sum(work) == n * (n + 1) // 2
        assert (min(work), max(work)) == (lo, hi), work
    contiguous = [_work(Layout(8, 2, layout="contiguous"), r, 4) for r in range(8)]
    assert min(contiguous) < max(contiguous) / 3


def test_rank_chunks():
    assert rank_chunks("zigzag", 4, 1) == (1, 6)
    assert rank_chunks("contiguous", 4, 1) == (2, 3)
    with pytest.raises(ValueError, match="layout='striped'"):
        rank_chunks("striped", 4, 0)
