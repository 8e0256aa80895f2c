"""ATLAS's gain over the best baseline, one mechanism at a time, on the same topology (launch/plan/gain.py):
the steps multiply to the total, and the same-GPU-set comparison uses exactly ATLAS's hosts and slots."""

import pytest

from launch.plan import gain
from launch.plan.placement import choose, make_plan
from launch.plan.socket_limits import DEFAULT_WINDOW
from tests.launch.plan.test_baselines import MODEL, T


def test_the_decomposition_multiplies_to_atlas_over_the_best_baseline():
    atlas = choose(T, MODEL)
    others = gain.compare(T, MODEL, DEFAULT_WINDOW)
    steps = gain.decompose(T, MODEL, atlas, others, DEFAULT_WINDOW)
    assert len(steps) == 6 and steps[-1].seconds == atlas.result.iteration
    assert steps[0].seconds == min(c.result.iteration for c in others.values() if c)
    product = 1.0
    for st in steps[1:]:
        product *= st.ratio
    assert product == pytest.approx(steps[0].seconds / atlas.result.iteration)
    # the same GPU set: every baseline layout uses exactly ATLAS's hosts and slots
    plan = make_plan(T, MODEL)
    same, same_steps = gain.same_gpus(T, MODEL, plan, atlas, DEFAULT_WINDOW)
    sub = gain.plan_topology(T, plan)
    assert sum(h.slots for h in sub.hosts) == plan.world_size
    for c in same.values():
        assert c is None or c.layout.gpus == plan.world_size
    assert same_steps[-1].seconds == atlas.result.iteration
