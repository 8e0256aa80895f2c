"""benchmarks.moe_sweep: the design spans every level of the issue's factors, and its --quick cells (the
CI smoke test) run every row through the same code the full sweep runs, in one world."""

import itertools
import statistics

import pytest

from benchmarks import moe_sweep as sweep


def test_design_spans_every_level_and_is_balanced():
    cells = sweep.cells()
    assert len(cells) >= 48
    factors = {"experts": sweep.EXPERTS, "k": sweep.KS, "capacity_factor": sweep.CAPACITY,
               "layout": sweep.LAYOUTS, "size": sweep.SIZES, "tokens": sweep.TOKENS}
    value = {"layout": lambda c: (c.tp, c.ep), "size": lambda c: (c.hidden, c.ffn)}
    for name, levels in factors.items():
        get = value.get(name, lambda c, name=name: getattr(c, name))
        counts = [sum(get(c) == level for c in cells) for level in levels]
        assert min(counts) == max(counts) == len(cells) // len(levels), (name, counts)
    # every pair of three-level factors meets at every pair of levels (the Latin square on the layout)
    for a, b in itertools.combinations(("experts", "k", "capacity_factor", "layout"), 2):
        ga, gb = (value.get(n, lambda c, n=n: getattr(c, n)) for n in (a, b))
        assert len({(ga(c), gb(c)) for c in cells}) == 9, (a, b)
    for c in cells:
        assert c.experts % c.ep == 0 and c.k <= c.experts


@pytest.mark.slow
@pytest.mark.world_size(4)
def test_quick_cells_run_every_row(world):
    for cfg in sweep.quick_cells():
        res = world.run(sweep._rank_cell, cfg, 1, 0)[0]
        assert set(res) == set(sweep.rows_for(cfg))
        cell = sweep.summarize(cfg, res)
        assert cell["auto"] in sweep.SCHEDULES and set(cell["predicted_ms"]) >= {cell["auto"]}
        assert cell["best"] in sweep.SCHEDULES and cell["best_vs_ds"] > 0
        assert cell["calls"]["ds"] > 0 and cell["bytes"]["parm"] > 0
        assert statistics.median(res["parm auto"]["ms"]) > 0


def test_cells_option_takes_indices_and_ranges_and_refuses_the_rest():
    assert sweep.parse_cells("0-2,40,1") == [0, 1, 2, 40]
    assert sweep.parse_cells("53") == [53]
    for bad, why in (("54", "must lie in 0-53"), ("3-1", "low to high"), ("a", "not an index"),
                     ("1,,2", "not an index"), ("-1", "not an index")):
        with pytest.raises(sweep.argparse.ArgumentTypeError, match=why):
            sweep.parse_cells(bad)
