"""Ranking by the simulator: branch and bound on the lower bound picks what exhaustive simulation
picks, on every shipped topology; the bound holds on their full-size candidates."""

import dataclasses
import glob

import pytest

from launch.plan import baselines, topology
from launch.plan.bound import lower_bound
from launch.plan.estimate import ModelSpec, build, fits
from launch.plan.placement import atlas_layouts
from launch.plan.search import best, exhaustive
from launch.plan.simulate import simulate
from launch.plan.socket_limits import DEFAULT_WINDOW

SHIPPED = sorted(glob.glob("configs/atlas_*.json"))
BOTH = ("spatial", "temporal")


def test_three_topologies_are_shipped():
    assert SHIPPED == ["configs/atlas_intercontinental.json", "configs/atlas_three_dc.json",
                       "configs/atlas_two_dc.json"]


@pytest.mark.parametrize("path", SHIPPED)
def test_branch_and_bound_picks_the_exhaustive_best(path):
    """Each shipped topology with a small model (every candidate simulated in a second or two)."""
    t = topology.load(path)
    model = dataclasses.replace(ModelSpec.from_dict(t.model), layers=6, global_batch=16)
    systems = [(list(atlas_layouts(t, model, DEFAULT_WINDOW)), BOTH)]
    if "two_dc" in path:   # the baselines' hostfile orders make them many: on one topology (3 DCs: 15 orders)
        systems += [(list(layouts(t, model)), ("spatial",)) for layouts in baselines.LAYOUTS.values()]
    for layouts, sharings in systems:
        every = exhaustive(t, model, layouts, DEFAULT_WINDOW, sharings)
        assert all(lb <= sim * (1 + 1e-9) for lb, sim, _ in every)
        found = best(t, model, layouts, DEFAULT_WINDOW, sharings)
        if not every:
            assert found is None
            continue
        assert found.result.iteration == pytest.approx(min(sim for _, sim, _ in every))
        assert found.simulated <= len(every)


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED)
def test_the_bound_holds_on_the_full_size_contenders(path):
    """The shipped model itself: every candidate whose bound is within 1.1x of the plan's time (a
    superset of what branch and bound simulates), under both sharing modes."""
    t = topology.load(path)
    model = ModelSpec.from_dict(t.model)
    jobs = [build(t, model, lay, DEFAULT_WINDOW) for lay in atlas_layouts(t, model, DEFAULT_WINDOW)
            if fits(t, model, lay)]
    bounds = [min(lower_bound(dataclasses.replace(j, sharing=m)) for m in BOTH) for j in jobs]
    plan = best(t, model, atlas_layouts(t, model, DEFAULT_WINDOW), DEFAULT_WINDOW, BOTH)
    near = [i for i, b in enumerate(bounds) if b <= 1.1 * plan.result.iteration]
    assert 2 * len(near) >= plan.simulated
    for i in near:
        for mode in BOTH:
            sim = simulate(dataclasses.replace(jobs[i], sharing=mode)).iteration
            assert bounds[i] <= sim * (1 + 1e-9)
            assert sim >= plan.result.iteration * (1 - 1e-9)
