"""benchmarks.moe_sweep_stability: two runs' fitted constants, predictions and picks side by side, from a
timed sweep's JSON and a --picks-only one alike."""

import json

import pytest

from benchmarks import moe_sweep_stability as stability
from ds_plugins import cost_cache

KEY = "world4-mp2-esp2-ep2-gloo"


def _config(tokens: int) -> dict:
    return {"tp": 2, "ep": 2, "experts": 8, "k": 2, "capacity_factor": 1.25, "hidden": 256, "ffn": 512,
            "tokens": tokens}


def test_compare_reports_ratios_and_picks(tmp_path, capsys):
    fitted = [1e-3, 2e-9] * ((cost_cache.width() - 1) // 2) + [1.0]
    doubled = [2 * v for v in fitted[:-1]] + [1.0]
    sweep = {"summary": {"load_before": "3.0", "load_after": "4.0"},
             "cells": [{"config": _config(t), "auto": pick, "predicted_ms": {"deepspeed": 10.0, "s1": 12.0},
                        "fitted": {KEY: fitted}} for t, pick in ((256, "deepspeed"), (1024, "s1"))]}
    picks = {"picks": [{"config": _config(t), "schedule": "deepspeed", "predicted_ms": {"deepspeed": 20.0,
                                                                                          "s1": 24.0},
                        "fitted": {KEY: doubled}} for t in (256, 1024)]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(sweep))
    b.write_text(json.dumps(picks))
    out = stability.compare(str(a), str(b))
    assert out["cells"] == 2 and out["same_pick"] == 1
    assert out["constant_ratio"] == pytest.approx([2.0, 2.0, 2.0])
    assert out["predicted_ratio"] == {"deepspeed": pytest.approx([2.0] * 3), "s1": pytest.approx([2.0] * 3)}
    text = capsys.readouterr().out
    assert "load 3.0 -> 4.0" in text and "untimed" in text and "s1 -> deepspeed" in text


def test_rescore_judges_one_runs_picks_on_another_runs_times(tmp_path, capsys):
    import torch

    from benchmarks import moe_layer
    from ds_plugins import cost_model, selector

    fitted = [1e-3, 2e-9] * ((cost_cache.width() - 1) // 2) + [1.0]
    costs = selector._from_tensor(torch.tensor(fitted, dtype=torch.float64))
    shape = moe_layer._layer_shape(moe_layer.Config(**_config(256)))
    t = {s: cost_model.predict(s, shape, costs).total for s in ("deepspeed", "s1", "s2")}
    pick = min(t, key=t.get)
    fits = tmp_path / "fits.json"
    fits.write_text(json.dumps({"picks": [{"config": _config(256), "schedule": pick, "predicted_ms": {},
                                           "fitted": {KEY: fitted}}]}))
    for slower, hits in ((1.0, 1), (1.2, 0)):   # the pick as fast as the others, then 20% slower
        raw = {f"parm {s}": [10.0 * (slower if s == pick else 1.0)] * 3 for s in ("deepspeed", "s1", "s2")}
        best = min(raw, key=lambda r: raw[r][0]).removeprefix("parm ") if slower > 1 else pick
        timed = tmp_path / "timed.json"
        timed.write_text(json.dumps({"cells": [{"config": _config(256), "best": best, "raw": raw}]}))
        assert stability.rescore(str(fits), str(timed))["hits"] == hits
