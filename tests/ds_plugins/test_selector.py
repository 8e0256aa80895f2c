"""The "auto" selector: one fit per layout on the layer's own groups at set-up, identical on every rank of
the layer, cached in a file; its choice from the agreed token count; no collective outside the layer's
groups in a forward; fitting without autograd and without moving the RNG."""

import os

import pytest
import torch
import torch.distributed as dist

from commweave import cost
from commweave.ledger import recording
from ds_plugins import ParmMoE, cost_model, selector
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

S, M, H, E = 64, 16, 32, 8


def _auto(cache_file: str):
    use_layout(2, 2)
    selector._fitted.clear()
    selector._decisions.clear()
    torch.manual_seed(1)   # the same gate and experts on every rank, as an engine's broadcast gives them
    layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=2, k=2, capacity_factor=1.25, min_capacity=0,
                    enable_expert_tensor_parallelism=True, cost_cache=cache_file)
    layer.set_deepspeed_parallelism()
    torch.manual_seed(0)
    x = torch.randn(S, M)
    layer(x)
    first = layer.last_schedule
    layer(x)  # decided once per shape: no new fit, no new decision
    fitted = selector._to_tensor(selector.fitted_costs(layer.parm_groups)).tolist()
    selector._fitted.clear()
    with recording() as led:
        reloaded = selector._to_tensor(selector.fitted_costs(layer.parm_groups, cache_file)).tolist()
    with recording() as passed:                   # the per-call overhead's pass: its calls as modelled
        shape, _ = selector._Bench(layer.parm_groups, x.device).exchange()
    lineups = 2 * selector.REPEATS               # an all-reduce over MP and over EP before each run
    calls = sum(v["calls"] for v in passed.as_dict().values()) - lineups
    return {"pass_calls": calls / selector.REPEATS, "modelled_calls": cost_model.exchange_calls(shape, True),
            "choice": first, "again": layer.last_schedule, "decisions": len(selector.decisions()),
            "fitted": fitted, "reloaded": reloaded, "reload_traffic": led.as_dict(),
            "file": os.path.exists(cache_file)}


@pytest.mark.world_size(4)
def test_auto_fits_once_agrees_on_every_rank_and_caches(world, tmp_path):
    res = world.run(_auto, str(tmp_path / "costs.json"))
    assert res[0]["choice"] in ("deepspeed", "s1", "s2")   # selector.candidates with MP 2
    for r in res:
        assert r["choice"] == r["again"] == res[0]["choice"] and r["decisions"] == 1
        assert r["fitted"] == res[0]["fitted"]                    # averaged over the world
        assert r["reloaded"] == pytest.approx(r["fitted"], rel=1e-12)
        # each rank's reading of the file agreed (ds_plugins.agreement.relay: over MP, EP, then MP again;
        # comm.disagreement sends the entry flag, the timeout, the message slots: 67 int64, 66 in the last
        # round), then the 21 float64 parameters MAX-reduced over MP then EP
        reduced = {"calls": 1, "sent": 21 * 8, "received": 21 * 8}
        assert r["reload_traffic"] == {
            "all_gather@mp": {"calls": 2, "sent": (67 + 66) * 8, "received": (67 + 66) * 8},
            "all_gather@ep": {"calls": 1, "sent": 67 * 8, "received": 67 * 8},
            "all_reduce@mp": reduced, "all_reduce@ep": reduced}
        assert r["file"]
        assert r["pass_calls"] == r["modelled_calls"] == 4 * 5   # A2A twice, AG and RS over ESP, AG over MP
    costs = selector._from_tensor(torch.tensor(res[0]["fitted"], dtype=torch.float64))
    for op in ("a2a@ep", "ag@esp", "rs@esp", "ag@mp", "gemm", "mem"):
        assert costs.ops[op].beta > 0, op
    assert costs("gate", 1024 * 8 * 4) > 0                   # the gating, timed at set-up
    assert set(costs.ops) == set(cost_model.OPS)


def _agreed_and_local(rank_tokens: list[int]) -> dict:
    """No token dropping, so EP peers may hold different token counts: "auto" decides from the agreed
    (largest) one. A layer set up as "s2" and switched to "auto" fits at its first forward, here under
    ``torch.inference_mode()``: no autograd, the RNG untouched, collectives on the layer's groups only."""
    use_layout(2, 2)
    selector._fitted.clear()
    selector._decisions.clear()
    torch.manual_seed(1)   # the same gate and experts on every rank, as an engine's broadcast gives them
    layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=2, k=2, capacity_factor=1.25, min_capacity=0,
                    drop_tokens=False, enable_expert_tensor_parallelism=True, schedule="s2")
    layer.set_deepspeed_parallelism()
    layer.schedule = "auto"
    torch.manual_seed(dist.get_rank() // 2)
    x = torch.randn(rank_tokens[dist.get_rank()], M)
    layer.eval()
    rng = torch.get_rng_state()
    with torch.inference_mode(), recording() as led:
        first = layer(x)[0]                       # fits, then routes (drawing the Gumbel noise)
    after_fit = torch.get_rng_state()
    torch.set_rng_state(rng)
    with torch.inference_mode():
        again = layer(x)[0]                       # decided already: routes only
    return {"choice": layer.last_schedule, "decided": [key[1].tokens for key in selector.decisions()],
            "groups": sorted({key.split("@")[1] for key in led.as_dict()}),
            "rng kept": torch.equal(after_fit, torch.get_rng_state()),
            "same output": torch.equal(first, again)}


@pytest.mark.world_size(4)
def test_auto_decides_from_the_agreed_token_count_on_the_layers_groups(world):
    res = world.run(_agreed_and_local, [24, 24, 200, 200])   # MP groups {0,1}, {2,3}; EP pairs (0,2), (1,3)
    for r in res:
        assert r["choice"] == res[0]["choice"] and r["decided"] == [200]
        assert set(r["groups"]) <= {"mp", "esp", "ep"}, r["groups"]
        assert r["rng kept"] and r["same output"]


def test_relative_fit_keeps_small_calls_and_large_ones():
    """The micro-benchmark's sizes span 64 B to 8 MiB: exact α + β·n comes back, and 10% noise on the
    largest point moves α by far less than an ordinary least-squares intercept does (which it sets)."""
    sizes = [64, 16e3, 128e3, 1e6, 8e6]
    alpha, beta = 300e-6, 1.5e-9
    exact = [alpha + beta * n for n in sizes]
    got = selector.fit_relative(sizes, exact)
    assert got.alpha == pytest.approx(alpha, rel=1e-9) and got.beta == pytest.approx(beta, rel=1e-9)
    noisy = [*exact[:-1], exact[-1] * 1.1]
    rel, ols = selector.fit_relative(sizes, noisy), cost.fit(sizes, noisy).model
    assert abs(rel.alpha - alpha) < 0.05 * alpha < abs(ols.alpha - alpha)
    assert selector.fit_relative(sizes, [1e-3] * 5) == cost.AlphaBeta(1e-3, 0.0)   # flat: no slope


def test_local_work_is_timed_over_runs_of_at_least_the_window(monkeypatch):
    """A call shorter than the window runs back to back until the run lasts WINDOW_S; the time per call
    comes back (on a clock that a call moves by 3 ms: one untimed call, then REPEATS runs of 7 calls)."""
    clock = [0.0]
    monkeypatch.setattr(selector.time, "perf_counter", lambda: clock[0])

    def work():
        clock[0] += 0.003
    bench = object.__new__(selector._Bench)      # no groups: local work only
    bench.device = torch.device("cpu")
    assert bench.steady(work) == pytest.approx(0.003)
    assert clock[0] == pytest.approx(0.003 * (1 + selector.REPEATS * 7))     # ceil(20 / 3) = 7
