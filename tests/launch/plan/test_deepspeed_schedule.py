"""DeepSpeed's pipeline engine in the simulator: its instruction order against DeepSpeed's own
TrainSchedule, and blocking rendezvous transfers against a hand-derived timeline."""

from dataclasses import replace

import pytest

from launch.plan.deepspeed_schedule import train_schedule
from launch.plan.simulate import Collective, Job, Route, simulate


def _deepspeed_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """DeepSpeed's TrainSchedule, each p2p/compute instruction with the micro-batch it moves."""
    from deepspeed.runtime.pipe import schedule as S

    names = {S.SendActivation: "send_act", S.RecvActivation: "recv_act", S.SendGrad: "send_grad",
             S.RecvGrad: "recv_grad", S.ForwardPass: "F", S.BackwardPass: "B"}
    sched = S.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
    out, prev = [], -1
    for step, cmds in enumerate(sched.steps()):
        mb, _ = sched._step_to_micro_batch(step)
        for cmd in cmds:
            if type(cmd) in names:
                name = names[type(cmd)]
                out.append((name, prev if name.startswith("send") else mb))
        prev = mb
    return [*out, ("step", -1)]


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (3, 2), (3, 5), (4, 4), (5, 8)])
def test_instruction_order_is_deepspeeds(stages, micro_batches):
    for s in range(stages):
        assert train_schedule(s, stages, micro_batches) == _deepspeed_order(s, stages, micro_batches)


def _job(route: Route, replicas=1, micro_batches=2, sharing="spatial", step=0.0) -> Job:
    D = replicas
    return Job(((1.0,) * D, (1.0,) * D), ((2.0,) * D, (2.0,) * D), ((route,) * D,), 1.0, micro_batches,
               "deepspeed", sharing, (Collective(step), Collective(step)))


def test_hand_derived_two_stage_timeline():
    """t_f = 1, t_b = 2, a transfer takes 1 and lands 0.5 later. S1's recv of act 0 is posted at 0, S0's
    send at 1: the transfer runs 1..2, lands 2.5; S1 F0 2.5-3.5, B0 3.5-5.5, sends grad 0 (S0 waits in
    its recv since 3): 5.5..6.5, lands 7; only then S0 sends act 1 (7..8, lands 8.5), runs B0 8-10;
    S1 F1 8.5-9.5, B1 9.5-11.5, grad 1 11.5..12.5 lands 13; S0 B1 13-15."""
    r = simulate(_job(Route(0.5, 1.0)))
    assert r.iteration == pytest.approx(15.0)
    got = {(t.fwd, t.m): [t.started, t.done, t.arrives] for t in r.transfers}
    want = {(True, 0): [1, 2, 2.5], (False, 0): [5.5, 6.5, 7], (True, 1): [7, 8, 8.5],
            (False, 1): [11.5, 12.5, 13]}
    assert sorted(got) == sorted(want)
    for key, times in want.items():
        assert got[key] == pytest.approx(times)
    ops = sorted((o.stage, o.kind, o.micro_batch, o.start, o.end) for o in r.ops)
    assert (0, "backward", 0, 8.0, 10.0) in ops and (1, "forward", 1, 8.5, 9.5) in ops


def test_step_and_loss_broadcast_end_the_iteration():
    # the reduce/optimizer step adds to every row; the loss reaches stage 0 one latency after stage 1
    assert simulate(_job(Route(0.5, 1.0), step=0.25)).iteration == pytest.approx(15.25)
    r = simulate(_job(Route(5.0, 1.0), micro_batches=1))
    # F0 0-1, act 1..2 lands 7, F 7-8, B 8-10, grad 10..11 lands 16, B 16-18; S1's loss lands at 11 + 5
    assert r.iteration == pytest.approx(18.0)


@pytest.mark.parametrize("sharing, expected", [("spatial", 2.0), ("temporal", 1.0)])
def test_replicas_on_a_filled_link(sharing, expected):
    """Two replicas' first activations on one WAN link that either transfer fills alone: spatially
    they share it (both done at 2), temporally the first goes at full rate (done at 1)."""
    r = simulate(_job(Route(0.5, 1.0, ("a", "b"), 1, 1.0), replicas=2, micro_batches=1, sharing=sharing))
    first = min(t.done for t in r.transfers if t.fwd and t.m == 0)
    assert first == pytest.approx(1.0 + expected)     # both sends are posted after F0 at t = 1


def test_window_limited_connections_gain_nothing_from_turns():
    """One connection capped at a quarter of the link: temporal turns only delay the second replica."""
    spatial, temporal = (simulate(_job(Route(0.5, 1.0, ("a", "b"), 1, 0.25), replicas=2,
                                       sharing=s)).iteration for s in ("spatial", "temporal"))
    assert temporal >= spatial


def test_a_wan_spanning_dp_group_all_reduces_on_the_shared_link():
    """dp = 2 replicas of a 2-stage pipeline, replica 0 in DC a, replica 1 in b (the pipeline inside its
    DC: t_f = 1, t_b = 2, transfers 1 s + 0.5), one micro-batch; replica 1's stage 0 backward takes 3.
    Each stage's gradient ring crosses the WAN both ways (1 byte/s per direction, 0.1 s latency):
    stage 1 moves 4 bytes per direction, stage 0 2 bytes. Per replica: S0 F 0-1, act 1..2 lands 2.5,
    S1 F 2.5-3.5, B 3.5-5.5, grad 5.5..6.5 lands 7, S0 B 7-9 (replica 1: 7-10). Stage 1's all-reduce
    starts at 6.5 (both replicas there) and runs alone until stage 0's starts at 10, when the slower
    replica arrives (the collective waits for its whole group): stage 1 has 0.5 left, then shares the
    link at 0.5 bytes/s: done at 11, lands 11.1; stage 0 has moved 0.5 by 11, its last 1.5 at full rate:
    done 12.5, lands 12.6. The loss reaches stage 0 at 11.1 + 0.5. Iteration 12.6."""
    from launch.plan.simulate import WanFlow

    def ring(nbytes):
        return Collective(0.25, (WanFlow("a", "b", nbytes, 0.1, 1.0), WanFlow("b", "a", nbytes, 0.1, 1.0)))

    route = Route(0.5, 1.0)
    job = Job(((1.0, 1.0), (1.0, 1.0)), ((2.0, 3.0), (2.0, 2.0)), ((route, route),), 1.0, 1, "deepspeed",
              "spatial", (ring(2.0), ring(4.0)))
    r = simulate(job)
    assert r.iteration == pytest.approx(12.6)
    assert r.wan_bytes == pytest.approx(12.0)
    spans = {(o.stage, o.replica): (o.start, o.end) for o in r.ops if o.kind == "allreduce"}
    assert spans == {(0, 0): pytest.approx((10.0, 12.6)), (0, 1): pytest.approx((10.0, 12.6)),
                     (1, 0): pytest.approx((6.5, 11.1)), (1, 1): pytest.approx((6.5, 11.1))}


def test_identical_replicas_run_once_on_a_share_of_the_link():
    """Replicas in lockstep on a spatially shared link are simulated as one on bandwidth/D: the same
    iteration, ops and WAN bytes as the full simulation."""
    from launch.plan import deepspeed_schedule

    for schedule in ("deepspeed", "megatron"):
        job = replace(_job(Route(0.5, 1.0, ("a", "b"), 2, 0.3), replicas=3, micro_batches=3, step=0.25),
                      schedule=schedule)
        full = deepspeed_schedule._Engine(job).run()
        fast = deepspeed_schedule.run(job)
        assert fast[0] == pytest.approx(full[0]) and fast[3] == pytest.approx(full[3])
        assert sorted(map(_op_key, fast[2])) == sorted(map(_op_key, full[2]))


def _op_key(o):
    return o.stage, o.replica, o.kind, o.micro_batch, round(o.start, 9), round(o.end, 9)


def test_gloo_notices_a_tuples_second_tensor_and_the_steps_pipe_all_reduce():
    """The hand-derived case above with gloo's recv-ready notice (0.5 one way), a second, empty tensor
    per transfer (each its own call, posted once the first returned) and one all-reduce over the two
    stages in the step (launch.plan.rendezvous).
    act 0: S0 sends 1..2, lands 2.5; its 2nd tensor: S0 waits from 2, S1 posts at 2.5, notice at 3.0,
      lands 3.5. S0 F1 3-4, recv posted 4. S1 F0 3.5-4.5, B0 4.5-6.5; grad 0 6.5..7.5, lands 8; 2nd:
      S1 from 7.5, S0 posts 8, sent 8.5, lands 9. act 1: S1's recv (8.5) noticed at 9.0 = S0's send:
      9..10, lands 10.5; 2nd sent 11, lands 11.5. S0 B0 11-13. S1 F1 11.5-12.5, B1 12.5-14.5; grad 1
      14.5..15.5 lands 16; 2nd sent 16.5 lands 17. S0 B1 17-19.
    All-reduce: S1 in at 16.5, S0 at 19: S1's value leaves at 19.5, lands 20; the sum back at 20,
    S1 out at 20.5. Loss: S1 sends at 20.5 (S0's notice from 20 is there), S0 has it at 21."""
    job = replace(_job(Route(0.5, 1.0, notice=0.5)), extra_tensors=(0.0,), pipe_syncs=1)
    r = simulate(job)
    assert r.iteration == pytest.approx(21.0)
    ops = {(o.stage, o.kind, o.micro_batch): (o.start, o.end) for o in r.ops}
    assert ops[(0, "backward", 1)] == pytest.approx((17.0, 19.0))
    assert ops[(1, "backward", 1)] == pytest.approx((12.5, 14.5))
    assert ops[(0, "backward", 0)] == pytest.approx((11.0, 13.0))
    got = {(t.fwd, t.m): [t.started, t.done, t.arrives] for t in r.transfers}   # the first tensors
    want = {(True, 0): [1, 2, 2.5], (False, 0): [6.5, 7.5, 8], (True, 1): [9, 10, 10.5],
            (False, 1): [14.5, 15.5, 16]}
    assert sorted(got) == sorted(want)
    for key, times in want.items():
        assert got[key] == pytest.approx(times)
    # without the notice a late receive costs one latency, not a round trip
    plain = simulate(replace(job, routes=((Route(0.5, 1.0),),))).iteration
    assert plain < r.iteration
    with pytest.raises(ValueError, match="needs schedule='deepspeed'"):
        replace(job, schedule="megatron")
    with pytest.raises(ValueError, match="pipe_syncs=1 needs an engine schedule"):
        replace(job, extra_tensors=(), schedule="1f1b")
