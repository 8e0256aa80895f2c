"""The "auto" selector: one fit per layout on the real groups, identical on every rank, cached in a file."""

import os

import pytest
import torch

from commweave.ledger import recording
from ds_plugins import ParmMoE, cost_model, selector
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

S, M, H, E = 64, 16, 32, 8


def _auto(cache_file: str):
    use_layout(2, 2)
    selector._fitted.clear()
    selector._decisions.clear()
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
    return {"choice": first, "again": layer.last_schedule, "decisions": len(selector.decisions()),
            "fitted": fitted, "reloaded": reloaded, "reload_traffic": led.as_dict(),
            "file": os.path.exists(cache_file)}


@pytest.mark.world_size(4)
def test_auto_fits_once_agrees_on_every_rank_and_caches(world, tmp_path):
    res = world.run(_auto, str(tmp_path / "costs.json"))
    assert res[0]["choice"] in ("s1", "s2")
    for r in res:
        assert r["choice"] == r["again"] == res[0]["choice"] and r["decisions"] == 1
        assert r["fitted"] == res[0]["fitted"]                    # averaged over the world
        assert r["reloaded"] == pytest.approx(r["fitted"], rel=1e-12)
        flag = 2 * 8 * 3 // 4  # one int64 "have the file" flag, MIN-reduced over 4 ranks
        assert r["reload_traffic"] == {"all_reduce@world": {"calls": 1, "sent": flag, "received": flag}}
        assert r["file"]
    costs = selector._from_tensor(torch.tensor(res[0]["fitted"], dtype=torch.float64))
    for op in ("a2a@ep", "ag@esp", "rs@esp", "ag@mp", "gemm", "mem"):
        assert costs.ops[op].beta > 0, op
    assert set(costs.ops) == set(cost_model.OPS)
