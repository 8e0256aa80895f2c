"""BubbleTea in the simulator: the packed bubbles of planned iterations, and `launch.plan --bubbletea`."""

import json

import pytest

from launch.bubbletea.packer import check_placements
from launch.bubbletea.simulate import InferenceSpec, for_plan, simulate_bubbletea
from launch.plan import topology
from launch.plan.__main__ import main as plan_main
from launch.plan.estimate import ModelSpec, build
from launch.plan.placement import layout_of, make_plan
from launch.plan.simulate import Link, Pipeline, simulate

# An intercontinental case (hundreds of ms RTT, a few Gb/s): our own until configs/ ships one.
INTERCONTINENTAL = {
    "datacenters": {"us": {"hosts": [{"name": f"us-{i}", "slots": 8} for i in range(2)]},
                    "eu": {"hosts": [{"name": f"eu-{i}", "slots": 8} for i in range(2)]},
                    "ap": {"hosts": [{"name": "ap-0", "slots": 8}], "gpu_tflops": 150}},
    "wan": [{"between": ["us", "eu"], "rtt_ms": 150, "bandwidth_gbps": 5, "window_mb": 4},
            {"between": ["us", "ap"], "rtt_ms": 250, "bandwidth_gbps": 2, "window_mb": 4},
            {"between": ["eu", "ap"], "rtt_ms": 300, "bandwidth_gbps": 2, "window_mb": 4}],
    "model": {"layers": 48, "hidden": 6144, "seq": 2048, "micro_batch": 1, "global_batch": 256},
}


def test_packed_simulation_keeps_training_ops_and_fills_the_bubbles():
    wan = Link(latency=0.05, bandwidth=1e9, shared=True)
    p = Pipeline([0.02, 0.03], [0.04, 0.06], [wan], act_bytes=2e7, micro_batches=6, replicas=2)
    r = simulate(p)
    spec = InferenceSpec(params=1e8, layers=4, hidden=512, prompt_tokens=512, chunk_tokens=64, guard=1e-3)
    est = simulate_bubbletea(p, r, [100e12, 100e12], spec)
    train = [op for op in est.training_ops if op.kind in ("F", "B")]
    check_placements(est.training_ops, est.packing, spec.guard)
    assert est.utilisation_training == pytest.approx(r.utilisation)
    assert est.utilisation_training < 0.5 < 0.9 < est.utilisation <= 1.0
    busy = sum(pl.end - pl.start for pl in est.packing.placements)
    assert est.utilisation == pytest.approx(est.utilisation_training + busy / (4 * r.iteration))
    assert len(train) == 2 * 2 * 2 * 6
    assert est.prefill_tokens_per_s == pytest.approx(sum(pl.chunk.tokens for pl in est.packing.placements)
                                                     / r.iteration)


def test_slower_gpus_prefill_slower():
    p = Pipeline([0.02, 0.02], [0.04, 0.04], [Link(0.1, 1e9, shared=True)], act_bytes=1e6, micro_batches=4)
    r = simulate(p)
    fast = simulate_bubbletea(p, r, [200e12, 200e12])
    mixed = simulate_bubbletea(p, r, [200e12, 50e12])
    assert mixed.prefill_tokens_per_s < fast.prefill_tokens_per_s
    with pytest.raises(ValueError, match="stage_flops has 1 entries for 2 stages"):
        simulate_bubbletea(p, r, [1e12])


@pytest.fixture(scope="module")
def intercontinental():
    """(topology, model, ATLAS's plan for DeepSpeed) of the intercontinental case, planned once."""
    topo = topology.parse(INTERCONTINENTAL, source="intercontinental")
    # dp x tp fixed at 4 x 2 so that the plan crosses the WAN (us holds 16 GPUs): with DeepSpeed's schedule
    # the planner would otherwise keep inside us, where the bubbles are few
    model = ModelSpec(**INTERCONTINENTAL["model"], dp=4, tp=2)
    return topo, model, make_plan(topo, model, connections=8, window=4 * 2**20)


def test_intercontinental_plan_reaches_90_percent_with_bubbletea(intercontinental):
    topo, model, plan = intercontinental
    est = for_plan(topo, model, plan, window=4 * 2**20)
    assert plan.wan_boundaries()
    assert est.utilisation_training == pytest.approx(plan.estimate.utilisation, rel=1e-6)
    assert est.utilisation >= 0.90 > est.utilisation_training
    assert est.memory_fits


def test_a_plan_for_megatron_is_filled_in_megatrons_order(intercontinental):
    """A plan run by Megatron-LM (``launch.plan --engine megatron``): the what-if simulates its layout in
    Megatron's call order (the simulator's own result for that layout and engine), not DeepSpeed's,
    whose iteration on this layout is another length."""
    topo, model, plan = intercontinental
    est = for_plan(topo, model, plan, window=4 * 2**20, engine="megatron")
    megatron = simulate(build(topo, model, layout_of(plan, "megatron"), 4 * 2**20))
    assert est.utilisation_training == pytest.approx(megatron.utilisation, rel=1e-9)
    assert est.utilisation_training != pytest.approx(plan.estimate.utilisation, rel=1e-3)   # DeepSpeed's
    with pytest.raises(ValueError, match="for_plan: engine='varuna': one of deepspeed, megatron"):
        for_plan(topo, model, plan, engine="varuna")


def test_plan_cli_prints_the_bubbletea_line_and_json(tmp_path, capsys):
    path = tmp_path / "ic.json"
    path.write_text(json.dumps(INTERCONTINENTAL))
    assert plan_main([str(path), "--bubbletea", "--no-baselines"]) == 0   # the baselines: test_main
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  bubbletea GPU utilisation") for line in out)
    last = json.loads(out[-1])
    assert last["utilisation_bubbletea"] > last["utilisation"] > 0
    assert plan_main([str(path), "--no-baselines"]) == 0
    assert "bubbletea" not in capsys.readouterr().out
