"""The calibrated prediction's inputs: engine timings to stage compute, measured link modes, settings."""

import pytest

from launch.plan.calibrated import LinkMode, StageCompute, WanSetting, choose, compute_inputs, step_seconds


def test_compute_inputs_are_medians_per_stage():
    ranks = [(0, {"ForwardPass": 1.0, "LoadMicroBatch": 0.5, "BackwardPass": 2.0, "OptimizerStep": 0.1}),
             (0, {"ForwardPass": 3.0, "BackwardPass": 4.0, "ReduceGrads": 0.2, "OptimizerStep": 0.2}),
             (1, {"ForwardPass": 2.0, "LoadMicroBatch": 1.0, "BackwardPass": 5.0})]
    got = compute_inputs(ranks, 2)
    assert got[0] == StageCompute(pytest.approx(2.25), pytest.approx(3.0), pytest.approx(0.25))
    assert got[1] == StageCompute(3.0, 5.0, 0.0)
    with pytest.raises(ValueError, match="no rank reported stage 2"):
        compute_inputs(ranks, 3)


def test_the_hand_derived_timeline_through_measured_inputs():
    """tests/launch/plan/test_deepspeed_schedule.py's case: t_f 1, t_b 2, a transfer 1 + 0.5 latency."""
    compute = [StageCompute(1.0, 2.0, 0.0)] * 2
    assert step_seconds(compute, 1, 2, 1.0, 10.0, LinkMode(0.5, 1.0), WanSetting()) == pytest.approx(15.0)
    # 8 MiB striped over eight connections of a mode that reaches 8 MiB/s: the link is not the limit
    mib = 2**20
    assert step_seconds(compute, 1, 2, 8 * mib, 10 * mib, LinkMode(0.5, 8 * mib), WanSetting(8, "spatial")) \
        == pytest.approx(15.0)


def test_link_modes_and_settings():
    modes = {"stock": {"alpha_s": 0.01, "Bps": 4e6}, "8": {"alpha_s": 0.02, "Bps": 3e7}}
    assert LinkMode.from_measured(modes, "stock") == LinkMode(0.01, 4e6)
    assert LinkMode.from_measured(modes, "8:temporal") == LinkMode(0.02, 3e7)
    # below STRIPE_MIN_BYTES ATLAS sends whole, over one connection: the "1" mode, else the stock one
    assert LinkMode.from_measured(modes, "8:temporal", 256 * 1024) == LinkMode(0.01, 4e6)
    assert LinkMode.from_measured({**modes, "1": {"alpha_s": 0.03, "Bps": 5e6}}, "8:spatial", 1024) \
        == LinkMode(0.03, 5e6)
    with pytest.raises(ValueError, match="no measurement for '4'"):
        LinkMode.from_measured(modes, "4:spatial")
    assert WanSetting.parse("stock") == WanSetting(1, "spatial")
    assert WanSetting.parse("8:temporal") == WanSetting(8, "temporal")
    for bad in ("8", "0:spatial", "x:temporal", "8:both"):
        with pytest.raises(ValueError, match="use 'stock' or K:spatial"):
            WanSetting.parse(bad)


def test_choose_claims_temporal_only_beyond_the_margin():
    compute = [StageCompute(1.0, 2.0, 0.0)] * 2
    # one connection already fills the link (rate 1 = bandwidth): two replicas gain from taking turns
    modes = {"stock": {"alpha_s": 0.5, "Bps": 1.0}, "1": {"alpha_s": 0.5, "Bps": 1.0}}
    settings = ["stock", "1:spatial", "1:temporal"]
    best, predicted = choose(compute, 2, 4, 1.0, 1.0, modes, settings, allow_temporal=True)
    assert predicted["1:temporal"] < predicted["1:spatial"] / 1.05 and best == "1:temporal"
    # by default temporal is never chosen (the calibration matrix never measured it paying)
    assert choose(compute, 2, 4, 1.0, 1.0, modes, settings)[0] in ("stock", "1:spatial")   # equal here
    # a window-limited connection (a quarter of the link): turns gain nothing, spatial is kept
    modes = {"1": {"alpha_s": 0.5, "Bps": 0.25}}
    best, predicted = choose(compute, 2, 4, 1.0, 1.0, modes, ["1:spatial", "1:temporal"], allow_temporal=True)
    assert best == "1:spatial" and predicted["1:temporal"] >= predicted["1:spatial"]
    # within the margin, a predicted gain of temporal is not claimed
    modes = {"1": {"alpha_s": 0.5, "Bps": 1.0}}
    best, _ = choose(compute, 2, 4, 1.0, 1.0, modes, ["1:spatial", "1:temporal"], margin=10.0,
                     allow_temporal=True)
    assert best == "1:spatial"


def test_choose_predicts_with_the_rendezvous_terms():
    """The choice is made on the model the predictions are checked with: gloo's recv-ready notice, the
    tuple's further tensor and the step's all-reduces over the stages, for every setting alike."""
    compute = [StageCompute(1.0, 2.0, 0.0)] * 2
    modes = {"stock": {"alpha_s": 0.5, "Bps": 0.25}, "8": {"alpha_s": 0.5, "Bps": 1.0}}
    settings = ["stock", "8:spatial"]
    terms = {"one_way": 0.5, "extra_tensors": (4.0,), "syncs": 2}
    best, predicted = choose(compute, 2, 4, 8 * 2**20, 2**21, modes, settings, **terms)
    _, bare = choose(compute, 2, 4, 8 * 2**20, 2**21, modes, settings)
    for s in settings:
        mode, wan = LinkMode.from_measured(modes, s, 8 * 2**20), WanSetting.parse(s)
        assert predicted[s] == step_seconds(compute, 2, 4, 8 * 2**20, 2**21, mode, wan, **terms) > bare[s]
    assert best == "8:spatial"


def test_temporal_token_passes_when_the_send_returns_before_its_bytes_arrive():
    """A send returning within alpha went whole into the socket buffers: temporal sharing's token passes
    at once and the replicas share the link as with spatial sharing; a send that returns late holds it."""
    mib = 2**20
    measured = {"8": {"alpha_s": 0.008, "Bps": 5e7, "send_return_s": {"1024": 0.003, "4096": 0.07}}}
    mode = LinkMode.from_measured(measured, "8:temporal", mib)
    assert mode.send_return == ((mib, 0.003), (4 * mib, 0.07))
    assert mode.returns_before_arrival(mib) and not mode.returns_before_arrival(4 * mib)
    # linear between the sizes: 0.003 + 0.067 * (1.2 - 1) / 3 = 0.0075 < alpha; at 1.5 MiB 0.014
    assert mode.returns_before_arrival(1.2 * mib) and not mode.returns_before_arrival(1.5 * mib)
    assert not LinkMode(0.008, 5e7).returns_before_arrival(1)       # nothing measured: the token is held
    compute = [StageCompute(0.02, 0.03, 0.01)] * 2
    late = LinkMode(0.008, 5e7, ((mib, 0.05), (4 * mib, 0.2)))
    spatial, temporal = (step_seconds(compute, 2, 4, mib, 5e7, m, WanSetting(8, s)) for m, s in
                         ((mode, "spatial"), (mode, "temporal")))
    assert temporal == spatial
    held = step_seconds(compute, 2, 4, mib, 5e7, late, WanSetting(8, "temporal"))
    assert held != step_seconds(compute, 2, 4, mib, 5e7, late, WanSetting(8, "spatial"))
