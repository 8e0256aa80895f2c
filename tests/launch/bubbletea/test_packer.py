"""The packer: hand-worked placements, and over many random timelines it never overlaps a training op,
keeps the guard band, never places a chunk that would overrun its window, and keeps request order."""

import random

import pytest

from launch.bubbletea.packer import Chunk, Request, check_placements, pack
from launch.bubbletea.timeline import Op, Window, extract_windows, from_simulation
from launch.plan.simulate import Link, Pipeline, simulate


def _per_token(seconds):
    return lambda ch: seconds * ch.tokens


def test_earliest_fit_with_a_guard_band():
    windows = [Window(0, 0.0, 1.0), Window(0, 2.0, 5.0)]
    # 4 chunks of 0.4 s: [0, 0.4] fits before 1.0 − 0.3; [0.4, 0.8] would end 0.2 before the training op
    # at 1.0, inside the guard band: it goes to the next window, and so does the rest, back to back.
    got = pack(windows, [Request("r", 8)], chunk_tokens=2, cost=_per_token(0.2), guard=0.3)
    assert [p.chunk.lo for p in got.placements] == [0, 2, 4, 6]
    assert [x for p in got.placements for x in (p.start, p.end)] == pytest.approx(
        [0.0, 0.4, 2.0, 2.4, 2.4, 2.8, 2.8, 3.2])
    assert got.deferred == []


def test_a_chunk_that_fits_nowhere_is_deferred_with_the_rest_of_its_request():
    windows = [Window(0, 0.0, 1.0)]
    got = pack(windows, [Request("big", 10), Request("small", 2)], chunk_tokens=5, cost=_per_token(0.1),
               guard=0.1)
    # big: chunk [0, 5) takes 0.5 s, [5, 10) would end at 1.0 (no guard left): deferred.
    # small: its one chunk of 0.2 s still fits at 0.5 (ends 0.7, guard to 0.8 <= 1.0).
    where = [(p.chunk.request, p.chunk.lo, p.start) for p in got.placements]
    assert where == [("big", 0, 0.0), ("small", 0, 0.5)]
    assert got.deferred == [Chunk("big", 5, 10, 10)]


def test_requests_stay_on_their_lane_and_a_free_request_takes_the_earliest_lane():
    windows = [Window("a", 3.0, 9.0), Window("b", 1.0, 9.0)]
    got = pack(windows, [Request("bound", 2, lane="a"), Request("free", 4), Request("late", 2, arrival=6.0)],
               chunk_tokens=2, cost=_per_token(0.5), guard=0.0)
    where = [(p.chunk.request, p.lane, p.start) for p in got.placements]
    assert where == [("bound", "a", 3.0), ("free", "b", 1.0), ("free", "b", 2.0), ("late", "a", 6.0)]


def test_resumed_request_starts_at_its_progress():
    got = pack([Window(0, 0.0, 10.0)], [Request("r", 10, done=6)], chunk_tokens=3, cost=_per_token(0.1),
               guard=0)
    assert [(p.chunk.lo, p.chunk.hi) for p in got.placements] == [(6, 9), (9, 10)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="guard=-1"):
        pack([], [], 4, _per_token(1.0), guard=-1)
    with pytest.raises(ValueError, match="chunk size must be >= 1"):
        pack([Window(0, 0, 1)], [Request("r", 3)], 0, _per_token(1.0), 0.0)
    with pytest.raises(ValueError, match="must take a positive time"):
        pack([Window(0, 0, 1)], [Request("r", 3)], 2, lambda ch: 0.0, 0.0)


def _random_case(rng: random.Random):
    if rng.random() < 0.5:              # a simulated pipeline iteration
        S = rng.randint(1, 4)
        links = [Link(rng.uniform(0, 1.5), rng.uniform(0.5, 3), shared=rng.random() < 0.5)
                 for _ in range(S - 1)]
        p = Pipeline([rng.uniform(0.2, 2) for _ in range(S)], [rng.uniform(0.2, 3) for _ in range(S)], links,
                     act_bytes=1.0, micro_batches=rng.randint(1, 8), replicas=rng.randint(1, 3),
                     schedule=rng.choice(["1f1b", "gpipe"]),
                     allreduce=[rng.uniform(0, 0.5) for _ in range(S)])
        r = simulate(p)
        return from_simulation(r), r.iteration
    ops, lanes = [], rng.randint(1, 4)   # arbitrary ops, some back to back, some overlapping
    for lane in range(lanes):
        t = rng.uniform(0, 1)
        for _ in range(rng.randint(0, 12)):
            d = rng.uniform(0.01, 2)
            ops.append(Op(lane, "T", t, t + d))
            t += d * rng.choice([0.5, 1.0, 1.0]) + rng.choice([0.0, rng.uniform(0, 2)])
    return ops, max([op.end for op in ops] + [1.0]) + rng.uniform(0, 2)


@pytest.mark.parametrize("seed", range(150))
def test_packing_never_touches_training(seed):
    rng = random.Random(seed)
    ops, iteration = _random_case(rng)
    windows = extract_windows(ops, iteration, min_window=rng.choice([0.0, 0.1]))
    guard = rng.choice([0.0, 0.01, 0.2])
    per_token = rng.uniform(0.002, 0.2)
    requests = [Request(i, rng.randint(1, 40), arrival=rng.uniform(0, iteration / 2),
                        lane=rng.choice([None, None, windows[0].lane if windows else None]))
                for i in range(rng.randint(1, 30))]
    size = rng.randint(1, 16)
    got = pack(windows, requests, size, _per_token(per_token), guard)
    check_placements(ops, got, guard)
    arrival = {r.id: r.arrival for r in requests}
    assert all(p.start >= arrival[p.chunk.request] - 1e-12 for p in got.placements)
    # every chunk is placed or deferred, exactly once; a request's deferred chunks are its tail
    placed = [(p.chunk.request, p.chunk.lo) for p in got.placements]
    deferred = [(c.request, c.lo) for c in got.deferred]
    assert sorted(placed + deferred) == sorted((c.request, c.lo) for r in requests for c in r.chunks(size))
    for rid, lo in deferred:
        assert all(p_lo < lo for p_rid, p_lo in placed if p_rid == rid)


def test_check_placements_catches_an_overlap():
    ops = [Op(0, "F", 1.0, 2.0)]
    got = pack([Window(0, 0.0, 1.0)], [Request("r", 1)], 1, _per_token(0.5), 0.0)
    check_placements(ops, got)
    bad = got.placements[0].__class__(got.placements[0].chunk, 0, 0.8, 1.3, got.placements[0].window)
    got.placements[0] = bad
    with pytest.raises(AssertionError):
        check_placements(ops, got)


def test_the_random_cases_do_pack_something():
    """The property above is not vacuous: most random cases place chunks."""
    packed = 0
    for seed in range(150):
        rng = random.Random(seed)
        ops, iteration = _random_case(rng)
        windows = extract_windows(ops, iteration)
        got = pack(windows, [Request(i, 8) for i in range(5)], 4, _per_token(0.01), 0.01)
        packed += bool(got.placements)
    assert packed >= 120
