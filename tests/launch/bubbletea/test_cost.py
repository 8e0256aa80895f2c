"""The chunk cost model: the running mean, the tail the start rule uses (a quantile of the recent measured /
fitted ratios, never below the mean, forgotten after its horizon), and its settings."""

import pytest

from launch.bubbletea.cost import CostModel
from launch.bubbletea.packer import Chunk

CHUNK = Chunk("r", 0, 32, 256)
FIT = (1e-3, 0.0, 0.0)                   # every chunk fitted at 1 ms


def _seen(ratios, quantile=0.9, t=0.0, horizon=2.0):
    costs = CostModel(FIT, quantile, horizon)
    for i, r in enumerate(ratios):
        costs.observe(CHUNK, r * 1e-3, t + 1e-3 * i)
    return costs


def test_the_tail_is_the_nearest_rank_quantile_of_the_recent_ratios():
    # twenty chunks: eighteen at the fit, two at 3x (a burst): the mean hardly moves, the p90 is the 18th
    # smallest (nearest rank: ceil(0.9 * 20) = 18) and the p95 the 19th, a slow one
    ratios = [1.0] * 9 + [3.0] + [1.0] * 9 + [3.0]
    costs = _seen(ratios, t=10.0)
    assert costs.fitted(CHUNK) == pytest.approx(1e-3)
    mean = 1.0
    for r in ratios:
        mean = 0.8 * mean + 0.2 * r
    assert costs.ratio == pytest.approx(mean) and costs.mean(CHUNK) == pytest.approx(mean * 1e-3)
    assert costs.tail_ratio(10.02) == pytest.approx(max(mean, 1.0))
    assert _seen(ratios, 0.95, t=10.0).tail(CHUNK, 10.02) == pytest.approx(3e-3)
    assert _seen([1.0] * 17 + [2.0, 2.5, 3.0], t=10.0).tail_ratio(10.02) == pytest.approx(2.0)


def test_the_tail_is_never_below_the_mean_and_forgets_after_its_horizon():
    costs = _seen([4.0] * 10, t=0.0)          # a burst: every chunk 4x
    assert costs.tail_ratio(0.5) == pytest.approx(4.0)
    # 3 s later (horizon 2 s) no sample is left: the tail is the mean, which fades at every plan
    before = costs.ratio
    costs.fade()
    assert costs.ratio == pytest.approx(1.0 + 0.8 * (before - 1.0))
    assert costs.tail_ratio(3.0) == pytest.approx(costs.ratio)
    fast = _seen([0.5] * 10)                  # the quantile below the mean: the mean (still ~0.55)
    assert fast.tail_ratio(0.02) == pytest.approx(fast.ratio) and fast.ratio > 0.5


def test_no_quantile_is_the_mean_rule_and_a_refit_starts_over():
    costs = _seen([1.0] * 9 + [5.0], quantile=None)
    assert costs.tail(CHUNK, 0.0) == pytest.approx(costs.mean(CHUNK))
    tailed = _seen([1.0] * 9 + [5.0], quantile=1.0)
    assert tailed.tail_ratio(0.0) == pytest.approx(5.0)
    tailed.refit((2e-3, 0.0, 0.0))
    assert (tailed.ratio, tailed.tail(CHUNK, 0.0)) == (1.0, pytest.approx(2e-3))


@pytest.mark.parametrize("quantile", [0.0, 1.5, -0.1, True, "0.9"])
def test_a_bad_quantile_is_refused(quantile):
    with pytest.raises(ValueError, match=r"tail_quantile=.*: must lie in \(0, 1\], or be None"):
        CostModel(FIT, quantile)


def test_a_bad_horizon_is_refused():
    with pytest.raises(ValueError, match=r"horizon=0\.0: the tail's samples must live a positive time"):
        CostModel(FIT, 0.9, horizon=0.0)


@pytest.mark.parametrize("built", ["same", "other"])
@pytest.mark.parametrize("quantile, ran", [(0.9, 0), (None, 1)])
def test_the_service_starts_a_chunk_only_if_its_tail_cost_ends_before_the_deadline(quantile, ran, built):
    """Recent chunks: eight at the fit (10 ms), two at 5x. A window closing in 30 ms: the mean (~21 ms
    after the plan's fade) fits, the p90 (50 ms) does not; the mean rule starts the chunk, the p90 rule
    skips it as too long for the window's rest. Built with the other rule and switched by a ("quantile",
    q) message before the plan: the same, from the same samples."""
    import array
    import time

    import torch

    from launch.bubbletea.model import LMConfig
    from launch.bubbletea.service import Service

    out = []
    window = memoryview(array.array("d", [0.0, 0.0]))
    setup = {"model": LMConfig(vocab=50, hidden=16, layers=1, heads=2, max_seq=8), "chunk_tokens": 8,
             "guard": 0.0, "cost": (0.01, 0.0, 0.0),
             "tail_quantile": quantile if built == "same" else {0.9: None, None: 0.9}[quantile]}
    service = Service(lambda *msg: out.append(msg), window, setup)
    now = time.perf_counter()
    for r in [1.0] * 8 + [5.0] * 2:
        service.costs.observe(Chunk("old", 0, 8, 8), r * 0.01, now)
    if built == "other":
        service.handle(("quantile", quantile))
    service.handle(("submit", "r", torch.arange(8), now))
    service.handle(("windows", [(1, 0.0, 60.0)]))                     # planned into a long window ...
    window[1], window[0] = time.perf_counter() + 0.03, 1.0           # ... that closes in 30 ms
    service.handle(("open", 1, 1.0))
    assert sum(m[0] == "chunk" for m in out) == ran
    assert [m for m in out if m[0] == "skipped"] == ([("skipped", 1, "short")] if not ran else [])
