"""The baselines' layouts follow the rules of the systems they stand for, with the freedom those systems
have (launch/plan/baselines.py)."""

import pytest

from launch.plan import baselines, gain, topology
from launch.plan.estimate import ModelSpec, build, stage_layers
from launch.plan.search import exhaustive
from launch.plan.socket_limits import DEFAULT_WINDOW

RAW = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": 4}, {"name": "a1", "slots": 2}]},
                       "b": {"hosts": [{"name": "b0", "slots": 2}], "gpu_tflops": 50}},
       "wan": [{"between": ["a", "b"], "rtt_ms": 100, "bandwidth_gbps": 2}]}
MODEL = ModelSpec(layers=4, hidden=256, seq=128, global_batch=8)
T = topology.parse(RAW, source="t")


def test_stock_takes_any_hostfile_order_and_any_number_of_gpus():
    """Ranks fill the hostfile in order (a0 a0 a0 a0 a1 a1 then b0 b0, or b first); any pp·tp·dp <= 8."""
    lays = list(baselines.deepspeed_layouts(T, MODEL))
    assert {lay.gpus for lay in lays} == {1, 2, 3, 4, 6, 8}
    assert all(lay.connections == 1 and lay.sharing == "spatial" and not lay.atlas_runtime for lay in lays)
    assert any(not lay.crosses_wan for lay in lays)                           # e.g. inside a
    a_first = next(lay for lay in lays if (lay.pp, lay.tp, lay.dp) == (2, 1, 4) and lay.dc[0][0] == "a")
    assert a_first.dc == (("a", "a", "a", "a"), ("a", "a", "b", "b"))         # stage 1 straddles the WAN
    job = build(T, MODEL, a_first, DEFAULT_WINDOW)
    assert [r.wan for r in job.routes[0]] == [None, None, ("a", "b"), ("a", "b")]
    assert [(f.src, f.dst) for f in job.collectives[1].flows] == [("a", "b"), ("b", "a")]
    assert any(lay.dc[0] == ("b", "b") for lay in lays)                       # a hostfile listing b first
    assert all(list(lay.stage_layers) == stage_layers(4, lay.pp) for lay in lays)


def test_megatron_moves_layers_only_to_the_first_and_last_stage():
    assert baselines.megatron_split(10, [1.0, 1.0, 1.0], [10] * 3) in ([3, 4, 3], [4, 3, 3], [3, 3, 4])
    assert baselines.megatron_split(48, [150.0, 400.0, 400.0], [48] * 3) == [7, 20, 21]
    assert baselines.megatron_split(48, [1.5e14, 4e14, 4e14], [20, 21, 22]) == [7, 20, 21]   # FLOP/s
    split = baselines.megatron_split(12, [1.0, 2.0, 2.0, 1.0], [12] * 4)
    assert split[1] == split[2] and sum(split) == 12
    assert baselines.megatron_split(12, [1.0, 2.0, 2.0, 1.0], [2, 12, 12, 12]) is not None
    assert baselines.megatron_split(3, [1.0] * 4, [3] * 4) is None
    # every split it offers is one megatron-core accepts: the middle stages equal
    for lay in baselines.megatron_layouts(T, MODEL):
        assert len(set(lay.stage_layers[1:-1])) <= 1 and sum(lay.stage_layers) == 4


def test_megatron_split_is_the_best_of_megatrons_splits():
    """Brute force over megatron-core's rule: no [f, m.., m, l] has a smaller max(n_s / v_s)."""
    speeds = [90.0, 150.0, 400.0, 400.0, 150.0]
    got = baselines.megatron_split(40, speeds, [40] * 5)
    best = min(max(n / v for n, v in zip([f, m, m, m, 40 - f - 3 * m], speeds, strict=True))
               for m in range(1, 13) for f in range(1, 40 - 3 * m))
    assert max(n / v for n, v in zip(got, speeds, strict=True)) == pytest.approx(best)


def test_dp_across_the_wan_keeps_each_replica_in_one_dc_and_orders_ranks_by_dc():
    lays = list(baselines.dp_wan_layouts(T, MODEL))
    assert {len(set(lay.dc[0])) for lay in lays} == {1, 2}                    # one DC is allowed too
    for lay in lays:
        assert all(stage == lay.dc[0] for stage in lay.dc)                    # a replica never moves DC
        assert list(lay.dc[0]) == sorted(lay.dc[0])                           # ranks ordered by DC
    across = next(lay for lay in lays if len(set(lay.dc[0])) == 2)
    job = build(T, MODEL, across, DEFAULT_WINDOW)
    assert all(r.wan is None for row in job.routes for r in row)              # only gradients cross
    assert all(c.flows for c in job.collectives)


def test_varuna_like_keeps_stages_in_their_dc_and_has_no_tp():
    lays = list(baselines.varuna_layouts(T, MODEL))
    assert {len({s[0] for s in lay.dc}) for lay in lays} == {1, 2}
    for lay in lays:
        assert lay.tp == 1 and lay.connections == 1 and lay.sharing == "spatial"
        assert all(len(set(stage)) == 1 for stage in lay.dc)                  # a stage stays in its DC
    fixed = ModelSpec(layers=4, hidden=256, seq=128, global_batch=8, tp=2)
    assert {lay.tp for lay in baselines.deepspeed_layouts(T, fixed)} == {2}
    assert list(baselines.varuna_layouts(T, fixed)) == []                     # Varuna has no TP


def test_every_baseline_is_the_exhaustive_best_of_its_layouts():
    found = gain.compare(T, MODEL, DEFAULT_WINDOW)
    for name, layouts in baselines.LAYOUTS.items():
        times = [t for _, t, _ in exhaustive(T, MODEL, list(layouts(T, MODEL)), DEFAULT_WINDOW)]
        assert found[name].result.iteration == pytest.approx(min(times))
