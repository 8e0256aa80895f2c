"""ATLAS placement: Algorithm 1, the DC-ordered layout against DeepSpeed's and Megatron's rank
orders, the search, and its errors."""

import copy
import math
from itertools import product

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core.parallel_state import RankGenerator

from launch.plan import socket_limits, topology
from launch.plan.__main__ import main
from launch.plan.estimate import ModelSpec
from launch.plan.placement import assign_hosts, fill_connections, make_plan, place, render
from launch.plan.plan import Plan

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
    assert labels == ["temporal sharing (unvalidated)", "1 connection",
                      "1 connection, temporal sharing (unvalidated)"]


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
    assert main(["configs/atlas_two_dc.json", "--wan-connections", "8", "--no-baselines"]) == 0
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


def test_connections_fill_the_link_within_nccls_limit():
    t = _topo(bandwidth_gbps=10, rtt_ms=40, window_mb=2)       # B·RTT = 50 MB, 2 MiB per connection
    assert fill_connections(t, ("big", "small"), tp=1, window=2**30) == math.ceil(50e6 / 2**21)
    assert fill_connections(t, ("big", "small"), tp=4, window=2**30) == math.ceil(50e6 / 4 / 2**21)
    assert fill_connections(t, ("big", "big"), tp=1, window=2**30) == 1          # nothing crosses
    assert fill_connections(_topo(bandwidth_gbps=400, window_mb=1), ("big", "small"), 1, 2**30) == 64


def test_the_planner_chooses_connections_and_keeps_spatial_sharing_unless_asked():
    """Connections are chosen (they fill the link); sharing stays spatial by default, where the idealised
    model would pick temporal (on a 10 Gb/s x 40 ms link with 4 replicas it predicts it faster): the
    calibration matrix never measured temporal paying. "auto" lets the model choose, "temporal" forces it."""
    t = _topo(bandwidth_gbps=10, rtt_ms=40)
    m = ModelSpec(layers=16, hidden=4096, seq=2048, global_batch=64, pp=3, tp=1, dp=4)
    plan = make_plan(t, m, window=WINDOW)
    assert plan.wan_boundaries() and plan.sharing == "spatial"
    assert plan.connections == fill_connections(t, plan.stage_dc, plan.tp, WINDOW)
    temporal = dict(plan.what_if)["temporal sharing (unvalidated)"]
    assert temporal < plan.estimate.iteration                       # the model's claim, not backed
    auto = make_plan(t, m, sharing="auto", window=WINDOW)
    assert auto.sharing == "temporal" and auto.estimate.iteration == pytest.approx(temporal)
    assert make_plan(t, m, sharing="temporal", window=WINDOW).sharing == "temporal"
    with pytest.raises(ValueError, match=r"sharing='fair': must be one of \('spatial', 'temporal', 'auto'\)"):
        make_plan(t, m, sharing="fair", window=WINDOW)


def test_auto_keeps_spatial_where_one_transfer_cannot_fill_the_link():
    """One connection fixed on a 100 Gb/s x 40 ms link: a lone transfer gets 1/238 of it, so taking
    turns (temporal) wastes the link and even "auto" keeps spatial sharing."""
    m = ModelSpec(layers=16, hidden=4096, seq=2048, global_batch=64, pp=3, tp=1, dp=4)
    plan = make_plan(_topo(bandwidth_gbps=100, rtt_ms=40, window_mb=2), m, connections=1, sharing="auto")
    assert plan.wan_boundaries() and plan.sharing == "spatial"
    assert dict(plan.what_if)["temporal sharing (unvalidated)"] > plan.estimate.iteration


def test_layers_follow_gpu_speed():
    raw = {"datacenters": {"slow": {"hosts": [{"name": "s0", "slots": 1}], "gpu_tflops": 100},
                           "fast": {"hosts": [{"name": "f0", "slots": 1}], "gpu_tflops": 300}},
           "wan": [{"between": ["slow", "fast"], "rtt_ms": 1, "bandwidth_gbps": 100}]}
    m = ModelSpec(layers=8, hidden=1024, seq=512, global_batch=8, pp=2, tp=1, dp=1)
    plan = make_plan(topology.parse(raw), m, window=WINDOW)
    layers = dict(zip(plan.stage_dc, plan.stage_layers, strict=True))
    assert layers == {"slow": 2, "fast": 6}


def test_with_three_dcs_the_stage_order_avoids_the_slow_link():
    """One stage per DC; a-b and b-c are fast, a-c is slow: the pipeline runs a, b, c (or back)."""
    raw = {"datacenters": {d: {"hosts": [{"name": f"{d}0", "slots": 1}]} for d in "abc"},
           "wan": [{"between": ["a", "b"], "rtt_ms": 5, "bandwidth_gbps": 100},
                   {"between": ["b", "c"], "rtt_ms": 5, "bandwidth_gbps": 100},
                   {"between": ["a", "c"], "rtt_ms": 80, "bandwidth_gbps": 1}]}
    m = ModelSpec(layers=6, hidden=2048, seq=1024, global_batch=16, pp=3, tp=1, dp=1)
    plan = make_plan(topology.parse(raw), m, window=WINDOW)
    assert plan.stage_dc in (("a", "b", "c"), ("c", "b", "a"))


def test_the_plan_does_not_read_this_machines_sysctls(monkeypatch):
    before = make_plan(_topo(), MODEL)

    def refuse(*args, **kwargs):
        raise AssertionError("the planner read a sysctl")

    monkeypatch.setattr(socket_limits, "read_sysctl", refuse)
    monkeypatch.setattr(socket_limits, "host_window", refuse)
    assert make_plan(_topo(), MODEL) == before
    assert make_plan(_topo(), MODEL, window=socket_limits.DEFAULT_WINDOW) == before
