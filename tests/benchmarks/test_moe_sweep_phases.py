"""benchmarks.moe_sweep_phases: nested phases count once, the lumps pair measured and modelled work, and
the accuracy table splits a sweep's cells into the diagnosed ones and the validation ones."""

import pytest

from benchmarks import moe_sweep
from benchmarks import moe_sweep_phases as phases


def test_a_nested_timed_call_counts_in_the_outer_phase_only():
    clock = phases._Clock()
    inner = clock.wrap("dispatch+combine", lambda: 1)
    outer = clock.wrap("exchanges", lambda: inner() + 1)
    assert outer() == 2 and inner() == 1
    assert set(clock.spent) == {"exchanges", "dispatch+combine"} and clock.depth == 0


def test_lumps_cover_the_same_work_on_both_sides():
    measured = {p: 1.0 for p in phases.PHASES} | {"step": 9.0, "forward": 4.0}
    model = {"gate": 1.0, "agree": 0.5, "dispatch+combine": 2.0, "exchanges": 3.0, "experts": 4.0,
             "esp": 1.0, "mp": 0.25}
    got = phases.lumps({"measured": measured, "model": model})
    assert got == {"compute": (4.0, 6.75), "dispatch+combine": (1.0, 2.0), "exchanges": (2.0, 3.0),
                   "glue": (1.0, 0.0)}


def test_accuracy_splits_diagnosed_and_validation_cells():
    cells = moe_sweep.cells()
    picked = [0, 6]                                    # cell 0 diagnosed, cell 6 not
    assert 0 in phases.DIAGNOSED and 6 not in phases.DIAGNOSED
    sweep = [{"config": vars(cells[i]), "predicted_ms": {"deepspeed": 8.0, "s2": 9.0},
              "ms": {"deepspeed": 10.0, "s1": 12.0, "s2": 12.0}} for i in picked]
    acc = phases.accuracy(sweep)
    assert acc["diagnosed"] == {"deepspeed": [0.8], "s2": [0.75]}
    assert acc["validation"] == {"deepspeed": [0.8], "s2": [0.75]}
    with pytest.raises(ValueError, match="is not one of"):
        phases.accuracy([{"config": vars(cells[0]) | {"tokens": 3}, "predicted_ms": {}, "ms": {}}])
