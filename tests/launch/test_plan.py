"""ATLAS placement: Algorithm 1, the DC-ordered layout against DeepSpeed's and Megatron's rank
orders, the search, and its errors."""

import copy
from itertools import product

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core.parallel_state import RankGenerator

from launch import topology
from launch.estimate import ModelSpec
from launch.plan import Plan, assign_hosts, main, make_plan, place, render

TWO_DC = {
    "datacenters": {
        "small": {"hosts": [{"name": "s0", "slots": 4, "addr": "10.0.1.1"}], "ifname": "ens1"},
        "big": {"hosts": [{"name": "b0", "slots": 4, "addr": "10.0.2.1"}, {"name": "b1", "slots": 3},
                          {"name": "b2", "slots": 4}]},
    },
    "wan": [{"between": ["small", "big"], "rtt_ms": 40, "bandwidth_gbps": 100, "window_mb": 64}],
}
MODEL = ModelSpec(layers=16, hidden=4096, seq=2048, global_batch=64, micro_batch=1)
WINDOW = 2**21


def _topo(**wan):
    raw = copy.deepcopy(TWO_DC)
    raw["wan"][0].update(wan)
    return topology.parse(raw, source="two_dc")


def test_algorithm_1_fills_the_largest_dc_first_with_whole_stages():
    t = _topo()
    # tp=2: big has 4 + 2 + 4 = 10 usable GPUs (b1's third slot cannot hold a TP pair), small 4.
    assert place(t, pp=3, tp=2, dp=2) == ["big", "big", "small"]
    assert place(t, pp=2, tp=1, dp=4) == ["big", "big"]
    assert place(t, pp=4, tp=2, dp=2) is None       # 2 stages fit in big, 1 in small
    assert place(t, pp=1, tp=4, dp=4) is None       # a stage never spans data centers


def test_hostfile_is_in_stage_order_and_tp_aligned():
    t = _topo()
    hosts = assign_hosts(t, ["big", "big", "small"], tp=2, dp=2)
    assert [(h.name, h.slots, h.dc) for h in hosts] == [("b0", 4, "big"), ("b1", 2, "big"),
                                                        ("b2", 2, "big"), ("s0", 4, "small")]
    assert hosts[-1].ifname == "ens1" and hosts[0].addr == "10.0.2.1"


def _plan(pp, tp, dp, stage_dc, hosts):
    return Plan(pp, tp, dp, 4, tuple(stage_dc), tuple([1] * pp), tuple(hosts), 4, "temporal")


@pytest.mark.parametrize("pp, tp, dp", [(3, 2, 2), (2, 1, 4), (2, 2, 1), (1, 2, 2)])
def test_layout_matches_deepspeed_and_megatron(pp, tp, dp):
    t = _topo()
    stage_dc = place(t, pp, tp, dp)
    plan = _plan(pp, tp, dp, stage_dc, assign_hosts(t, stage_dc, tp, dp))
    ds = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for r in range(plan.world_size):
        c = ds.get_coord(r)
        assert (c.pipe, c.data, c.model) == plan.coord(r)
    mg = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert sorted(mg.get_ranks("pp")) == sorted([plan.rank(s, d, m) for s in range(pp)]
                                                for d, m in product(range(dp), range(tp)))
    assert sorted(mg.get_ranks("tp")) == sorted([plan.rank(s, d, m) for m in range(tp)]
                                                for s, d in product(range(pp), range(dp)))
    assert sorted(mg.get_ranks("dp")) == sorted([plan.rank(s, d, m) for d in range(dp)]
                                                for s, m in product(range(pp), range(tp)))
    for r in range(plan.world_size):
        stage, _, _ = plan.coord(r)
        host, local = plan.host_of(r)
        assert host.dc == stage_dc[stage]                       # stages stay in their DC
        assert plan.rank_of(host.name, local) == r
        assert plan.host_of(r - r % tp)[0] == host              # a TP group shares one host


def test_wan_pairs_connect_the_boundary_stages():
    t = _topo()
    plan = _plan(3, 2, 2, ["big", "big", "small"], assign_hosts(t, ["big", "big", "small"], 2, 2))
    assert plan.wan_boundaries() == [1]
    assert plan.wan_pairs() == [(4, 8), (5, 9), (6, 10), (7, 11)]
    assert all(plan.dc_of(a) == "big" and plan.dc_of(b) == "small" for a, b in plan.wan_pairs())


def test_search_crosses_a_fast_wan_and_avoids_a_slow_one():
    fast = make_plan(_topo(), MODEL, connections=8, window=WINDOW)
    assert fast.wan_boundaries() and set(fast.stage_dc) == {"big", "small"}
    slow = make_plan(_topo(bandwidth_gbps=0.001, rtt_ms=400), MODEL, connections=1, window=WINDOW)
    assert not slow.wan_boundaries() and set(slow.stage_dc) == {"big"}
    assert fast.estimate.simulated and fast.estimate.iteration < slow.estimate.iteration
    labels = [label for label, _ in fast.what_if]
    assert labels == ["spatial sharing", "1 connection", "1 connection, spatial sharing"]


def test_fixed_degrees_are_respected():
    m = ModelSpec(layers=8, hidden=256, seq=128, global_batch=16, pp=2, tp=1, dp=2)
    plan = make_plan(_topo(), m, connections=4, window=WINDOW)
    assert (plan.pp, plan.tp, plan.dp, plan.micro_batches) == (2, 1, 2, 8)


def test_plan_travels_as_base64_json():
    plan = make_plan(_topo(), MODEL, connections=4, window=WINDOW)
    text = plan.encode()
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=")
    assert Plan.decode(text) == plan


@pytest.mark.parametrize("model, message", [
    (ModelSpec(layers=8, hidden=256, seq=128, global_batch=32, pp=4, tp=2, dp=2),
     "too few GPUs for the plan: pp=4 stages of tp x dp = 4 GPUs"),
    (ModelSpec(layers=8, hidden=65536, seq=128, global_batch=32),
     "too few GPUs for the plan: the smallest layout needs"),
])
def test_infeasible_plans_say_too_few_gpus(model, message):
    with pytest.raises(ValueError, match=message):
        make_plan(_topo(), model, connections=4, window=WINDOW)


@pytest.mark.parametrize("raw, message", [
    ({"layers": 8, "hidden": 64, "seq": 16}, r"missing required key\(s\) \['global_batch'\]"),
    ({"layers": 8, "hidden": 64, "seq": 16, "global_batch": 6, "micro_batch": 4}, "multiple of"),
    ({"layers": 8, "hidden": 64, "seq": 16, "global_batch": 8, "heads": 2}, r"unknown key\(s\) \['heads'\]"),
    ({"layers": 2, "hidden": 64, "seq": 16, "global_batch": 8, "pp": 3}, "more stages than layers"),
    ({"layers": 0, "hidden": 64, "seq": 16, "global_batch": 8}, "model.layers must be a positive"),
])
def test_bad_model_sections(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_dict(raw)


@pytest.mark.parametrize("connections", [0, 65])
def test_connections_outside_nccl_limits(connections):
    with pytest.raises(ValueError, match="--wan-connections"):
        make_plan(_topo(), MODEL, connections=connections, window=WINDOW)


def test_cli_prints_the_plan_and_reports_errors(capsys, tmp_path):
    assert main(["configs/atlas_two_dc.json", "--wan-connections", "8"]) == 0
    out = capsys.readouterr().out
    assert "ATLAS plan for configs/atlas_two_dc.json" in out and "hostfile (DC order" in out
    bad = tmp_path / "t.json"
    bad.write_text('{"datacenters": {"a": {"hosts": [{"name": "h", "slots": 1}]}}, "wan": '
                   '[{"between": ["a", "b"], "rtt_ms": 1, "bandwidth_gbps": 1}]}')
    assert main([str(bad)]) == 2
    assert "unknown data center 'b'" in capsys.readouterr().err


def test_render_lists_stages_wan_and_hostfile():
    t = _topo()
    plan = make_plan(t, MODEL, connections=8, window=WINDOW)
    text = render(plan, t, MODEL)
    for s in range(plan.pp):
        assert f"\n  {s:<5}  {plan.stage_dc[s]:<12}" in text
    assert "WAN      stage" in text and "8 TCP connections per pair" in text
    assert text.endswith("\n".join(f"    {line}" for line in plan.hostfile().splitlines()))
