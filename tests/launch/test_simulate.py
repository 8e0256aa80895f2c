"""The iteration simulator against hand-derived cases (atlas.md §1.5) and closed forms."""

from itertools import pairwise

import pytest

from launch.simulate import Link, Pipeline, schedule_ops, simulate

WAN = Link(latency=0.5, bandwidth=1.0, shared=True)   # one micro-batch (1 byte) takes 1 time unit


def _wan_pipe(sharing, replicas, micro_batches, schedule="1f1b"):
    return Pipeline(t_f=[1, 1], t_b=[2, 2], links=[WAN], act_bytes=1.0, micro_batches=micro_batches,
                    replicas=replicas, schedule=schedule, sharing=sharing)


@pytest.mark.parametrize("sharing, expected", [
    # atlas.md §1.5 worked example: (replica, micro-batch) -> (transfer done, arrival)
    ("spatial", {(0, 0): (4.0, 4.5), (1, 0): (4.0, 4.5), (0, 1): (5.0, 5.5), (1, 1): (5.0, 5.5)}),
    ("temporal", {(0, 0): (2.0, 2.5), (1, 0): (3.0, 3.5), (0, 1): (4.0, 4.5), (1, 1): (5.0, 5.5)}),
])
def test_worked_example_transfer_times(sharing, expected):
    r = simulate(_wan_pipe(sharing, replicas=2, micro_batches=2, schedule="gpipe"))
    got = {(tr.d, tr.m): (tr.done, tr.arrives) for tr in r.transfers if tr.fwd}
    assert sorted(got) == sorted(expected)
    for key, times in expected.items():
        assert got[key] == pytest.approx(times)


@pytest.mark.parametrize("schedule, replicas, spatial, temporal", [
    ("1f1b", 2, 26.0, 22.0), ("1f1b", 4, 39.0, 25.0), ("1f1b", 8, 71.0, 40.0), ("gpipe", 4, 41.0, 36.0),
])
def test_toy_table_of_the_design_note(schedule, replicas, spatial, temporal):
    """atlas.md §1.5 toy fluid simulation: M = 4, t_f = 1, t_b = 2, c = 1, L = 0.5."""
    got = [simulate(_wan_pipe(s, replicas, 4, schedule)).iteration for s in ("spatial", "temporal")]
    assert got == pytest.approx([spatial, temporal])


def test_temporal_transfers_never_overlap_and_follow_token_order():
    r = simulate(_wan_pipe("temporal", replicas=3, micro_batches=4))
    for fwd in (True, False):
        trs = sorted((tr for tr in r.transfers if tr.fwd == fwd), key=lambda tr: tr.started)
        assert [(tr.m, tr.d) for tr in trs] == sorted((tr.m, tr.d) for tr in trs)
        for a, b in pairwise(trs):
            assert b.started >= a.done - 1e-9


def test_no_communication_gives_the_1f1b_closed_form():
    S, M, tf, tb = 4, 6, 1.0, 2.0
    free = Link(latency=0.0, bandwidth=float("inf"))
    p = Pipeline([tf] * S, [tb] * S, [free] * (S - 1), act_bytes=1.0, micro_batches=M, replicas=2)
    r = simulate(p)
    assert r.iteration == pytest.approx((M + S - 1) * (tf + tb))
    assert r.utilisation == pytest.approx(M / (M + S - 1))


def test_per_transfer_cap_limits_one_flow_but_not_the_link():
    """A transfer capped at a quarter of the link: alone it takes 4 units, two at once still 4 each
    (spatial uses the spare capacity), taking turns they finish at 4 and 8 (temporal)."""
    capped = Link(latency=0.0, bandwidth=1.0, shared=True, per_transfer_cap=0.25)
    base = dict(t_f=[1, 1], t_b=[1, 1], links=[capped], act_bytes=1.0, micro_batches=1, replicas=2)
    spatial = simulate(Pipeline(**base, sharing="spatial"))
    temporal = simulate(Pipeline(**base, sharing="temporal"))
    fwd = lambda r: sorted(tr.done - tr.released for tr in r.transfers if tr.fwd)  # noqa: E731
    assert fwd(spatial) == pytest.approx([4.0, 4.0])
    assert fwd(temporal) == pytest.approx([4.0, 8.0])


def test_allreduce_is_added_after_the_last_backward():
    free = Link(latency=0.0, bandwidth=float("inf"))
    p = Pipeline([1, 1], [1, 1], [free], act_bytes=1.0, micro_batches=2, allreduce=[5.0, 0.5])
    # stage 0 does its last backward at (M + S − 1)·2 = 6, then its all-reduce takes 5.
    assert simulate(p).iteration == pytest.approx(11.0)


def test_schedules():
    assert schedule_ops("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert schedule_ops("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                              ("B", 2), ("B", 3)]
    assert schedule_ops("1f1b", 2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(t_b=[1]), "must describe S stages"),
    (dict(micro_batches=0), "micro_batches=0"),
    (dict(schedule="zb"), "Pipeline.schedule='zb'"),
    (dict(sharing="fair"), "Pipeline.sharing='fair'"),
])
def test_bad_pipelines(kwargs, message):
    base = dict(t_f=[1, 1], t_b=[1, 1], links=[WAN], act_bytes=1.0, micro_batches=2)
    with pytest.raises(ValueError, match=message):
        Pipeline(**{**base, **kwargs})
