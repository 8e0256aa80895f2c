"""The baselines' layouts follow the rules of the systems they stand for (launch/plan/baselines.py)."""

from launch.plan import baselines, topology
from launch.plan.estimate import ModelSpec, build
from launch.plan.socket_limits import DEFAULT_WINDOW

RAW = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": 4}, {"name": "a1", "slots": 2}]},
                       "b": {"hosts": [{"name": "b0", "slots": 2}]}},
       "wan": [{"between": ["a", "b"], "rtt_ms": 100, "bandwidth_gbps": 2}]}
MODEL = ModelSpec(layers=4, hidden=256, seq=128, global_batch=8)
T = topology.parse(RAW, source="t")


def test_stock_takes_every_gpu_in_hostfile_order():
    """8 GPUs, ranks a0 a0 a0 a0 a1 a1 b0 b0; tp divides every host (1 or 2)."""
    lays = list(baselines.stock_layouts(T, MODEL))
    assert {(lay.pp, lay.tp, lay.dp) for lay in lays} == {(1, 1, 8), (2, 1, 4), (4, 1, 2),
                                                           (1, 2, 4), (2, 2, 2), (4, 2, 1)}
    assert all(lay.gpus == 8 and lay.connections == 1 and lay.sharing == "spatial" for lay in lays)
    three = next(lay for lay in lays if (lay.pp, lay.tp) == (2, 1))
    assert three.dc == (("a", "a", "a", "a"), ("a", "a", "b", "b"))   # stage 1 straddles the WAN
    job = build(T, MODEL, three, DEFAULT_WINDOW)
    assert [r.wan for r in job.routes[0]] == [None, None, ("a", "b"), ("a", "b")]
    assert [(f.src, f.dst) for f in job.collectives[1].flows] == [("a", "b"), ("b", "a")]
    assert job.collectives[0].flows == ()


def test_dp_across_the_wan_keeps_each_replica_in_one_dc_and_orders_ranks_by_dc():
    lays = list(baselines.dp_wan_layouts(T, MODEL))
    assert lays
    for lay in lays:
        assert lay.dp >= 2 and len(set(lay.dc[0])) == 2
        assert all(stage == lay.dc[0] for stage in lay.dc)                # a replica never moves DC
        assert list(lay.dc[0]) == sorted(lay.dc[0])                        # ranks ordered by DC
    job = build(T, MODEL, lays[0], DEFAULT_WINDOW)
    assert all(r.wan is None for row in job.routes for r in row)           # only gradients cross
    assert all(c.flows for c in job.collectives)


def test_varuna_like_pipelines_cross_dcs_with_dp_inside_and_no_tp():
    lays = list(baselines.varuna_layouts(T, MODEL))
    assert lays
    for lay in lays:
        assert lay.tp == 1 and lay.connections == 1 and lay.sharing == "spatial"
        assert all(len(set(stage)) == 1 for stage in lay.dc)               # a stage stays in its DC
        assert len({stage[0] for stage in lay.dc}) == 2
        assert lay.dc[0][0] == "a"                                         # Algorithm 1: largest first


def test_a_model_section_that_fixes_tp_fixes_it_for_the_baselines():
    fixed = ModelSpec(layers=4, hidden=256, seq=128, global_batch=8, tp=2)
    assert {lay.tp for lay in baselines.stock_layouts(T, fixed)} == {2}
    assert list(baselines.varuna_layouts(T, fixed)) == []                  # Varuna has no TP
