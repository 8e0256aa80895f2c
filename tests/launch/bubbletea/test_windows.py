"""Windows from ATLAS's simulated schedule: its idle gaps land on the rank's wait instructions with their
lengths; plan and measurement combined and compared; the engine prefills from the plan before it measured."""

import time
import types

import pytest
import torch

from launch.bubbletea.timeline import Window
from launch.bubbletea.windows import WAITS, combine, compare, engine_plan, instruction_names, plan_windows
from launch.plan.simulate import Link, Pipeline, simulate
from launch.plan.timeline import idle_windows

WAN = Link(latency=0.5, bandwidth=1.0)


def _plan(schedule="1f1b"):
    return simulate(Pipeline(t_f=[1, 1], t_b=[2, 2], links=[WAN], act_bytes=1.0, micro_batches=4,
                             schedule=schedule))


@pytest.mark.parametrize("stage", [0, 1])
def test_the_plans_gaps_become_the_wait_instructions_windows(stage):
    result = _plan()
    names = instruction_names(4, 2, stage)
    got = plan_windows(result.ops, result.iteration, (stage, 0), names, lane=stage)
    gaps = idle_windows(result.ops, result.iteration)[(stage, 0)]
    # every idle gap of the row is one window, on a wait instruction of the rank, of the gap's length
    assert all(names[w.tag] in WAITS for w in got) and all(w.lane == stage for w in got)
    assert [(w.start, w.end) for w in got] == gaps
    expected = {0: ["RecvGrad"] * 3, 1: ["RecvActivation", "RecvActivation", "AggregateLoss"]}[stage]
    assert [names[w.tag] for w in got] == expected
    if stage == 1:           # the last stage first waits for stage 0's forward and the WAN
        assert got[0].start == 0.0 and got[0].length == pytest.approx(1.0 + 0.5 + 1.0)   # F + latency + bytes


def test_deepspeeds_executor_gives_each_receive_its_round_trip():
    """DeepSpeed's order (deepspeed_schedule.py): stage 0 sends micro-batch m's activation only after it
    received m − 1's gradient, so each RecvGrad waits the whole round trip: send 1 s of bytes, 0.5 s
    latency, stage 1's F (1) and B (2), the gradient's 1 s + 0.5 s back. By hand (t: seconds): F(0) 0-1,
    SendActivation(0) 1-2, F(1) 2-3, RecvGrad(0) 3-7 (stage 1: act at 2.5, F, B till 5.5, grad 5.5-6.5,
    here at 7), SendActivation(1) 7-8, B(0) 8-10, F(2) 10-11, RecvGrad(1) 11-13, ..., RecvGrad(3) 22-25,
    B(3) 25-27. With the transfers, a window is the receive alone (not the send after it in the gap)."""
    result = engine_plan(Pipeline(t_f=[1, 1], t_b=[2, 2], links=[WAN], act_bytes=1.0, micro_batches=4))
    assert result.iteration == pytest.approx(27.0)
    names = instruction_names(4, 2, 0)
    got = plan_windows(result.ops, result.iteration, (0, 0), names, transfers=result.transfers)
    assert [(names[w.tag], w.start, w.end) for w in got] == [
        ("SendActivation", 1.0, 2.0), ("RecvGrad", 3.0, 7.0), ("RecvGrad", 11.0, 13.0),
        ("RecvGrad", 17.0, 19.0), ("RecvGrad", 22.0, 25.0)]
    whole = plan_windows(result.ops, result.iteration, (0, 0), names)     # the gaps: receive + send
    assert [(w.start, w.end) for w in whole][1:3] == [(3.0, 8.0), (11.0, 14.0)]
    names = instruction_names(4, 2, 1)           # stage 1: SendGrad(m - 1), then RecvActivation(m)
    got = plan_windows(result.ops, result.iteration, (1, 0), names, transfers=result.transfers)
    assert [(names[w.tag], w.start, w.end) for w in got][:3] == [
        ("RecvActivation", 0.0, 2.5), ("RecvActivation", 6.5, 8.5), ("RecvActivation", 12.5, 14.5)]
    # the idealised 1F1B overlaps the round trips with stage 0's forwards: 9 s of windows, not 12
    ideal = _plan()
    assert sum(w.length for w in plan_windows(ideal.ops, ideal.iteration, (0, 0), instruction_names(4, 2, 0))
               ) == pytest.approx(9.0)


def test_with_clipping_the_last_stages_tail_is_its_optimizer_step():
    """DeepSpeed clips gradients by a norm all-reduced over the stages, so stage 1 (done with B(3) at 23.5,
    its SendGrad(3) gone at 24.5) waits in OptimizerStep until stage 0 ends B(3) at 27: the window is
    OptimizerStep's, not the loss broadcast's (stage 1 is its root: no wait there)."""
    result = engine_plan(Pipeline(t_f=[1, 1], t_b=[2, 2], links=[WAN], act_bytes=1.0, micro_batches=4))
    names = instruction_names(4, 2, 1)
    plain = plan_windows(result.ops, result.iteration, (1, 0), names, transfers=result.transfers)
    synced = plan_windows(result.ops, result.iteration, (1, 0), names, transfers=result.transfers,
                          step_sync=True)
    assert (names[plain[-1].tag], plain[-1].start, plain[-1].end) == ("AggregateLoss", 23.5, 27.0)
    assert (names[synced[-1].tag], synced[-1].start, synced[-1].end) == ("OptimizerStep", 24.5, 27.0)
    assert synced[:-1] == plain[:-1]
    first = plan_windows(result.ops, result.iteration, (0, 0), instruction_names(4, 2, 0),
                         transfers=result.transfers, step_sync=True)      # stage 0 arrives last: no wait
    assert "OptimizerStep" not in [instruction_names(4, 2, 0)[w.tag] for w in first]


def test_the_engine_waits_in_the_optimizer_step_only_where_it_clips_over_stages():
    from launch.bubbletea.engine import BubbleTea, step_sync

    def engine(clip, stages):
        return types.SimpleNamespace(global_rank=0, gradient_clipping=lambda: clip, num_stages=stages)

    assert step_sync(engine(1.0, 2)) and not step_sync(engine(0.0, 2)) and not step_sync(engine(1.0, 1))
    server = types.SimpleNamespace()
    assert "OptimizerStep" in BubbleTea(engine(1.0, 2), server).waits
    assert BubbleTea(engine(0.0, 2), server).waits == WAITS


def test_megatrons_order_posts_the_activation_with_the_gradients_receive():
    """Megatron-LM's 1F1B (megatron_schedule.py) on the same pipeline: stage 0's steady call posts
    send_forward(1) with recv_backward(0), so micro-batch 1's activation waits only for stage 1 to post its
    receive (after its B(0), at 5.5), not for gradient 0 to reach stage 0 (7): by hand, stage 1's F(1) at
    7 (DeepSpeed's 8.5), stage 0's B(0) 7-9 and the iteration 22.5 s (DeepSpeed's 27), stage 1's windows
    0-2.5 (F(0)'s activation), 5.5-7, 10-11.5, 14.5-16 and, with no loss broadcast, 19 to the end."""
    pipe = Pipeline(t_f=[1, 1], t_b=[2, 2], links=[WAN], act_bytes=1.0, micro_batches=4)
    result = engine_plan(pipe, "megatron")
    assert result.iteration == pytest.approx(22.5)
    ops = {(o.stage, o.kind, o.micro_batch): (o.start, o.end) for o in result.ops}
    assert ops[(1, "forward", 1)] == (7.0, 8.0) and ops[(0, "backward", 0)] == (7.0, 9.0)
    gaps = idle_windows(result.ops, result.iteration)
    assert gaps[(1, 0)] == [(0.0, 2.5), (5.5, 7.0), (10.0, 11.5), (14.5, 16.0), (19.0, 22.5)]
    assert gaps[(0, 0)] == [(1.0, 2.0), (3.0, 7.0), (10.0, 11.5), (14.5, 16.0), (18.0, 20.5)]
    # the job's own schedule is replaced by the engine's
    assert engine_plan(pipe.job(), "megatron").iteration == pytest.approx(22.5)
    with pytest.raises(ValueError, match="engine='gpipe': one of deepspeed, megatron"):
        engine_plan(pipe, "gpipe")


def test_a_plan_of_another_schedule_is_refused():
    result = _plan("gpipe")
    with pytest.raises(ValueError, match=r"row \(0, 0\)'s plan runs FFFFBBBB but the rank's schedule "
                                         r"runs FFBFBFBB: not the same pipeline schedule"):
        plan_windows(result.ops, result.iteration, (0, 0), instruction_names(4, 2, 0))


def test_both_takes_the_measurement_and_scales_the_plan_where_it_has_none():
    plan = [Window(0, 0.0, 1.0, 3), Window(0, 2.0, 4.0, 7), Window(0, 5.0, 5.5, 9)]
    measured = [Window(0, 0.1, 1.6, 3), Window(0, 2.2, 5.2, 7)]                # 1.5x the plan
    assert combine("plan", plan, measured) == plan and combine("measured", plan, measured) == measured
    assert combine("both", plan, []) == plan                                      # plan first
    both = combine("both", plan, measured)
    assert both[:2] == measured and both[2].tag == 9 and both[2].length == pytest.approx(0.75)
    report = compare(plan, measured)
    assert report["median_rel_diff"] == pytest.approx(0.5)
    assert report["windows"][2] == {"tag": 9, "plan_ms": 500.0, "measured_ms": None}
    with pytest.raises(ValueError, match="windows='guess': one of measured, plan, both"):
        combine("guess", plan, measured)


def test_the_engine_prefills_from_the_plan_before_any_measurement():
    from launch.bubbletea import LMConfig, PrefillServer
    from launch.bubbletea.engine import BubbleTea

    got = []
    server = PrefillServer(LMConfig(vocab=64, hidden=32, layers=1, heads=2, max_seq=48, seed=11), 16,
                           callback=got.append, guard=5e-4, cost=(1e-3, 0.0, 0.0), runner="stream")
    plan = [Window(0, 0.002, 0.202, 1)]                   # a 200 ms wait at instruction 1
    bt = BubbleTea(types.SimpleNamespace(global_rank=0), server, warmup=0, windows_from="plan", plan=plan)
    try:
        server.submit("p", torch.arange(40) % 64)
        for _ in range(20):                      # one iteration on an idle machine, more when others load it
            bt.begin_iteration()
            assert bt._on and bt.windows() == plan and bt.measured_windows(0.0) == []   # nothing measured
            for kind, seconds in (("ForwardPass", 0.002), ("RecvActivation", 0.2), ("BackwardPass", 0.002)):
                with bt.instruction(kind):
                    time.sleep(seconds)
            bt.end_iteration()
            bt.wait_idle()
            if got:
                break
        assert [r.request for r in got] == ["p"]
        report = bt.window_report()
        assert report["source"] == "plan" and report["windows"] == [{"tag": 1, "plan_ms": 200.0,
                                                                     "measured_ms": None}]
    finally:
        server.stop()
