"""Are "auto"'s fitted costs stable across runs? Two runs of benchmarks.moe_sweep side by side.

    python -m benchmarks.moe_sweep --compare RUN1.json RUN2.json

Each file is a sweep's ``--json`` (timed cells) or a ``--picks-only --json`` file (picks and predictions,
untimed). Printed: every fitted constant of both runs per layout with the ratio run 2 / run 1, the ratio
of the two runs' predicted forward + backward times per schedule over the cells both hold (min / median
/ max), and how many cells got the same pick. With ``--cost-cache`` run 2 reads run 1's costs, so every
constant, prediction and pick must be identical; without it, both runs fit on their own at their own
machine load, and the ratios show how far the fit moves with the load.
"""

from __future__ import annotations

import json
import re
import statistics

from ds_plugins import cost_model

TIE = 0.05
"""auto's pick counts as right when it is at most this much slower than the fastest Parm schedule."""
SCHEDULES = ("deepspeed", "s1", "s2")
"""The Parm schedules a sweep times and auto chooses among (with MP; without, S1 = S2)."""


def paired(base: list[float], times: list[float]) -> float:
    """The paired ratio of two rows timed in the same rounds: the median over rounds of base / times."""
    return statistics.median(b / t for b, t in zip(base, times, strict=True))


def _cells(path: str) -> tuple[dict, list[dict]]:
    """(the run's summary or {}, its cells as {"key", "pick", "predicted_ms", "fitted"})."""
    with open(path) as f:
        data = json.load(f)
    cells = []
    for c in data.get("cells", data.get("picks", [])):
        g = c["config"]
        key = (g["tp"], g["ep"], g["experts"], g["k"], g["capacity_factor"], g["hidden"], g["ffn"],
               g["tokens"])
        cells.append({"key": key, "pick": c.get("auto", c.get("schedule")), "predicted_ms": c["predicted_ms"],
                      "fitted": c["fitted"]})
    return data.get("summary") or {}, cells          # None: a run cut short, its cells kept


def _fitted(cells: list[dict]) -> dict[str, list[float]]:
    out = {}
    for c in cells:
        out.update(c["fitted"])
    return out


def compare(first: str, second: str) -> dict:
    (sum_a, a), (sum_b, b) = _cells(first), _cells(second)
    for name, path, summary in (("run 1", first, sum_a), ("run 2", second, sum_b)):
        load = f"load {summary['load_before']} -> {summary['load_after']}" if summary else "untimed"
        print(f"{name}: {path} ({load})")
    fa, fb = _fitted(a), _fitted(b)
    ratios = []
    for key in sorted(set(fa) & set(fb)):
        print(f"\n{key}: fitted constant, run 1 -> run 2 (ratio)")
        for i, op in enumerate(cost_model.OPS):
            parts = []
            for j, (unit, scale) in enumerate((("us", 1e6), ("ns", 1e9))):
                x, y = fa[key][2 * i + j], fb[key][2 * i + j]
                r = y / x if x > 0 else (1.0 if y == 0 else float("inf"))
                if x > 0 or y > 0:
                    ratios.append(r)
                parts.append(f"{'alpha' if j == 0 else 'beta'} {x * scale:.4g} -> {y * scale:.4g} {unit} "
                             f"({r:.2f})")
            if any(v > 0 for v in (fa[key][2 * i], fa[key][2 * i + 1], fb[key][2 * i], fb[key][2 * i + 1])):
                print(f"  {op:<8} " + ", ".join(parts))
        print(f"  overlap  {fa[key][-1]:.2f} -> {fb[key][-1]:.2f}")
    by_b = {c["key"]: c for c in b}
    pairs = [(c, by_b[c["key"]]) for c in a if c["key"] in by_b]
    pred = {}
    for x, y in pairs:
        for s, t in x["predicted_ms"].items():
            if s in y["predicted_ms"] and t > 0:
                pred.setdefault(s, []).append(y["predicted_ms"][s] / t)
    print(f"\npredicted fwd+bwd time, run 2 / run 1, over {len(pairs)} cells (min / median / max):")
    for s, r in pred.items():
        print(f"  {s:<10} {min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f}")
    same = sum(x["pick"] == y["pick"] for x, y in pairs)
    print(f"same pick in {same}/{len(pairs)} cells; fitted constants' ratio run 2 / run 1: "
          f"{min(ratios):.2f} to {max(ratios):.2f} (median {statistics.median(ratios):.2f})")
    for x, y in pairs:
        if x["pick"] != y["pick"]:
            print(f"  {x['key']}: {x['pick']} -> {y['pick']} (predicted run 1 " +
                  ", ".join(f"{s} {t:.1f}" for s, t in x["predicted_ms"].items()) + "; run 2 " +
                  ", ".join(f"{s} {t:.1f}" for s, t in y["predicted_ms"].items()) + ")")
    out = {"cells": len(pairs), "same_pick": same, "constant_ratio": [min(ratios), statistics.median(ratios),
                                                                       max(ratios)],
           "predicted_ratio": {s: [min(r), statistics.median(r), max(r)] for s, r in pred.items()}}
    print(json.dumps(out))
    return out


def rescore(fits: str, measured: str) -> dict:
    """The picks that the fitted costs of run ``fits`` (a sweep's or --picks-only JSON) make for the cells
    of the timed run ``measured``, judged on ``measured``'s step times by the sweep's own rule (paired
    regret against its fastest schedule, a hit within ``TIE``): costs from one run, times from another."""
    import torch

    from benchmarks import moe_layer
    from ds_plugins import selector

    fitted = _fitted(_cells(fits)[1])
    with open(measured) as f:
        cells = json.load(f)["cells"]
    # the layout key (ds_plugins.selector.layout_key, "world4-mp2-esp2-ep2-gloo") by (tp, ep)
    layout = {tuple(int(re.search(f"-{g}(\\d+)-", key).group(1)) for g in ("mp", "ep")): key
              for key in fitted}
    regrets = []
    for c in cells:
        cfg = moe_layer.Config(**c["config"])
        costs = selector._from_tensor(torch.tensor(fitted[layout[(cfg.tp, cfg.ep)]], dtype=torch.float64))
        options = SCHEDULES if cfg.tp > 1 else ("deepspeed", "s2")
        t = {s: cost_model.predict(s, moe_layer._layer_shape(cfg), costs).total for s in options}
        pick, best, raw = min(t, key=t.get), c["best"], c["raw"]
        ms = {s: raw.get(f"parm {s}", raw["parm s2"]) for s in options}
        regrets.append(paired(ms[pick], ms[best]) - 1 if pick != best else 0.0)
    hits = sum(r <= TIE for r in regrets)
    print(f"costs of {fits} on the times of {measured}: within {TIE:.0%} in {hits}/{len(cells)}, "
          f"within 10% in {sum(r <= 0.10 for r in regrets)}, regret mean {statistics.mean(regrets):.1%}, "
          f"worst {max(regrets):.1%}")
    return {"hits": hits, "cells": len(cells), "mean_regret": statistics.mean(regrets)}

