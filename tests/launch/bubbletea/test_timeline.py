"""Bubble extraction: hand-worked windows, and the simulator adapter against the simulator itself."""

import itertools
import random

import pytest

from launch.bubbletea.timeline import Op, Window, busy_time, extract_windows, from_simulation, utilisation
from launch.plan.simulate import Link, Pipeline, simulate


def test_windows_of_a_hand_made_timeline():
    ops = [("a", "F", 1.0, 2.0), ("a", "B", 2.0, 4.0), ("a", "F", 5.0, 6.0), ("b", "F", 0.0, 3.0),
           ("b", "B", 2.5, 7.0)]          # overlapping ops on b: their union is busy
    got = extract_windows(ops, iteration=8.0)
    assert got == [Window("a", 0.0, 1.0), Window("a", 4.0, 5.0), Window("a", 6.0, 8.0), Window("b", 7.0, 8.0)]
    assert extract_windows(ops, 8.0, min_window=1.5) == [Window("a", 6.0, 8.0)]
    assert extract_windows(ops, 8.0, min_window=1.5, all_lanes=["c"])[-1] == Window("c", 0.0, 8.0)
    assert utilisation(ops, 8.0) == pytest.approx((4.0 + 7.0) / 16)
    assert busy_time([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)


def test_ops_outside_the_iteration_or_reversed_are_refused():
    with pytest.raises(ValueError, match="outside the iteration"):
        extract_windows([("a", "F", 0.0, 9.0)], iteration=8.0)
    with pytest.raises(ValueError, match=r"end 1\.0 is before start 2\.0"):
        Op("a", "F", 2.0, 1.0)


def test_1f1b_bubbles_without_communication():
    """S stages, M micro-batches, t_f = 1, t_b = 2, free links: stage s idles s·t_f at the start and
    (S−1−s)·t_f + ... at the end; in all (S−1)(t_f + t_b) per stage, (M+S−1)(t_f+t_b) iteration."""
    S, M = 4, 6
    free = Link(0.0, float("inf"))
    p = Pipeline([1.0] * S, [2.0] * S, [free] * (S - 1), act_bytes=1.0, micro_batches=M)
    r = simulate(p)
    windows = extract_windows(from_simulation(r), r.iteration)
    for s in range(S):
        mine = [w for w in windows if w.lane == (s, 0)]
        assert sum(w.length for w in mine) == pytest.approx((S - 1) * 3.0)
        if s:
            assert mine[0].start == 0.0 and mine[0].end == pytest.approx(s * 1.0)   # the warm-up bubble


def _random_pipeline(rng: random.Random) -> Pipeline:
    S = rng.randint(1, 4)
    links = [Link(rng.uniform(0, 2), rng.uniform(0.5, 3), shared=rng.random() < 0.5,
                  per_transfer_cap=rng.choice([float("inf"), 1.0])) for _ in range(S - 1)]
    return Pipeline([rng.uniform(0.5, 2) for _ in range(S)], [rng.uniform(0.5, 3) for _ in range(S)], links,
                    act_bytes=1.0, micro_batches=rng.randint(1, 6), replicas=rng.randint(1, 3),
                    schedule=rng.choice(["1f1b", "gpipe"]), sharing=rng.choice(["temporal", "spatial"]),
                    allreduce=[rng.uniform(0, 1) for _ in range(S)])


@pytest.mark.parametrize("seed", range(40))
def test_the_simulations_ops_as_lanes(seed):
    """The adapter's ops: per lane in schedule order, never overlapping, ending by the simulator's
    iteration, with the simulator's compute utilisation."""
    p = _random_pipeline(random.Random(seed))
    r = simulate(p)
    ops = from_simulation(r)
    train = [op for op in ops if op.kind in ("F", "B")]
    assert len(train) == 2 * len(p.t_f) * p.replicas * p.micro_batches
    assert utilisation(train, r.iteration) == pytest.approx(r.utilisation)
    assert max(op.end for op in ops) == pytest.approx(r.iteration)
    for lane in {op.lane for op in ops}:
        mine = [op for op in ops if op.lane == lane]
        assert all(b.start >= a.end - 1e-9 for a, b in itertools.pairwise(mine))
