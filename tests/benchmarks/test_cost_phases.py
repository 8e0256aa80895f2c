"""benchmarks.cost_phases: the exclusive CPU-time count of nested calls, the split, and the restore."""

import time
from types import SimpleNamespace

import pytest

from benchmarks.cost_phases import Phases, same_round_profile, split


def _busy(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_phases_count_nested_calls_exclusively_and_restore_the_functions():
    ns = SimpleNamespace()
    ns.inner = lambda: _busy(0.01)

    def outer():
        _busy(0.02)
        ns.inner()
        ns.inner()
    ns.outer = outer
    originals = (ns.outer, ns.inner)
    with Phases([(ns, "outer", "outer"), (ns, "inner", "inner")]) as ph:
        ns.outer()
        ns.inner()
    assert (ns.outer, ns.inner) == originals
    assert ph.incl["inner"] >= 0.03 and ph.excl["inner"] == ph.incl["inner"]
    assert ph.incl["outer"] >= 0.04
    # the two inner calls inside outer are taken out of it, the third (outside) is not
    inside = ph.incl["outer"] - ph.excl["outer"]
    assert 0.02 <= inside < ph.incl["inner"]
    assert ph.excl["outer"] >= 0.02
    assert ph.calls == {"outer": 1, "inner": 3}
    ph.reset()
    assert ph.incl == ph.excl == ph.calls == {}


def test_split_is_kernels_messages_and_the_rest():
    parts = split({"attend": 1.0, "attend_bwd": 0.5, "wait": 0.25, "all_gather": 0.125, "other": 9.0}, 2.0)
    assert parts == {"kernels": 1.5, "messages": pytest.approx(0.375), "rest": pytest.approx(0.125)}


def test_same_round_profile_takes_the_ranks_mean_and_the_rounds_median_of_each_call():
    """Each exact call's seconds become the median over rounds of the mean over ranks of its same-round
    times (counted by hand); the profile's other calls and everything else stay."""
    from dataclasses import replace

    from megatron_patches.specs import spec_profile

    prof = replace(spec_profile(4, 10.0, 10.0), calls={"fwd 512 256 8 64": 1.0, "bwd 256 512 8 64": 2.0})
    call = ("fwd", 512, 256, 8)
    ranks = [{"_calls": {call: [1.0, 5.0, 3.0]}}, {"_calls": {call: [3.0, 1.0, 1.0]}}]
    got = same_round_profile(prof, ranks, 64)   # means per round 2, 3, 2: median 2
    assert got.calls == {"fwd 512 256 8 64": 2.0, "bwd 256 512 8 64": 2.0}
    assert replace(got, calls=prof.calls) == prof
