"""Where a Parm layer's step goes, phase by phase, against the alpha-beta model's price of each phase.

    python -m benchmarks.moe_sweep_phases [--cells 0,7,20] [--rounds 5]     # cells of benchmarks.moe_sweep
    python -m benchmarks.moe_sweep_phases --accuracy SWEEP.json     # a sweep's predicted / measured times

The sweep's "auto" ranks the schedules well but predicts absolute times below the measured ones (issue 23).
This times one layer's forward + backward per schedule on the sweep's cells, split into the phases the
model prices (ds_plugins.cost_model.predict), by wrapping the functions the schedules call:

    gate         routing.route / route_shard (forward; its backward is in "rest bwd")
    fills        the fill counts' exchange with the headers, their check and the filled rows
    dispatch+combine  dispatch and combine, forward and backward (the fused kernels)
    exchanges    overlap.to_experts / from_experts, forward and backward (their autograd duals)
    experts      the local experts' forward (the "deepspeed" order's all-reduce inside)
    mp           S1's all-gather over MP (forward)
    rest bwd     the backward minus the phases above: the experts', the gate's and the mp backward
    glue         the step minus every phase: the forward's Python between them, the loss, autograd's set-up

each the median over rounds of this rank's seconds, then the mean over the 4 ranks; "step" is the slowest
rank's wall time (barrier to barrier), as the sweep measures it. The model's parts are set beside them:
gate, dispatch+combine, exchanges (fills included), experts (+ "esp", + "a2a" for the "deepspeed" order),
mp; the model's compute backward is 2/3 of its GEMMs and mem passes. Nothing here is fitted.

``--accuracy`` reads a ``benchmarks.moe_sweep --json`` file and prints, per schedule, "auto"'s predicted
forward + backward time over the measured one (min / median / max, and the share within 25%), in two sets:
the cells this module's phases were looked at on (:data:`DIAGNOSED`, the default ``--cells``: where a
missing term was found) and the rest (validation: cells nothing was derived from).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

from benchmarks import moe_layer
from benchmarks.moe_layer import Config
from benchmarks.moe_sweep import cells
from commweave.world import World

DIAGNOSED = (0, 1, 2, 3, 4, 5, 26, 27, 46, 47)
"""The cells whose phases were timed to find what the model missed (issue 23, parm-6)."""
PHASES = ("gate", "fills", "dispatch+combine", "exchanges", "experts", "mp", "rest bwd", "glue")


class _Clock:
    """Seconds per phase of the current step; nested timed calls count in the outermost phase only."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - t0
                self.depth -= 1
        return timed


@contextmanager
def _instrumented(clock: _Clock):
    """Wrap the schedules' phase functions (ds_plugins.schedules looks each up at call time)."""
    from ds_plugins import agreement, collectives, experts, overlap, routing, schedules

    fill_cls = overlap.FillExchange

    class TimedFills(fill_cls):
        __init__ = clock.wrap("fills", fill_cls.__init__)
        read = clock.wrap("fills", fill_cls.read)
        rows = clock.wrap("fills", fill_cls.rows)

    ops = torch.ops.commweave
    targets = [(routing, "route", "gate"), (routing, "route_shard", "gate"), (schedules, "dispatch",
               "dispatch+combine"), (schedules, "combine", "dispatch+combine"),
               (overlap, "to_experts", "exchanges"), (overlap, "from_experts", "exchanges"),
               (experts, "partial_sums", "experts"), (experts, "tensor_parallel", "experts"),
               (collectives, "gather_rows", "mp"), (agreement, "check_headers", "fills"),
               (ops, "dispatch_backward", "dispatch+combine"), (ops, "combine_backward", "dispatch+combine")]
    statics = [(overlap._ToExperts, "backward"), (overlap._FromExperts, "backward")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    saved_static = [(cls, name, cls.__dict__[name]) for cls, name in statics]
    try:
        for obj, name, phase in targets:
            setattr(obj, name, clock.wrap(phase, getattr(obj, name)))
        for cls, name, fn in saved_static:
            setattr(cls, name, staticmethod(clock.wrap("exchanges", fn.__func__)))
        overlap.FillExchange = TimedFills
        yield
    finally:
        overlap.FillExchange = fill_cls
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        for cls, name, fn in saved_static:
            setattr(cls, name, fn)


def _schedules(cfg: Config) -> tuple[str, ...]:
    return ("deepspeed", "s1", "s2") if cfg.tp > 1 else ("deepspeed", "s2")


@moe_layer.in_layout
def _rank_phases(cfg: Config, rounds: int) -> dict:
    from ds_plugins import cost_model, selector

    torch.manual_seed(100 + dist.get_rank() // cfg.tp)
    x = torch.randn(cfg.tokens, cfg.hidden, requires_grad=True)
    go = torch.randn(cfg.tokens, cfg.hidden)
    layers = {s: moe_layer._layer(f"parm {s}", cfg) for s in _schedules(cfg)}
    g = next(iter(layers.values())).parm_groups
    costs = selector.fitted_costs(g)
    sh = moe_layer._layer_shape(cfg)
    clock = _Clock()
    seen: dict[str, dict[str, list[float]]] = {s: defaultdict(list) for s in layers}
    with _instrumented(clock):
        for i in range(rounds + 1):                                 # the first round warms up
            for s in list(layers)[i % len(layers):] + list(layers)[:i % len(layers)]:
                layer = layers[s]
                clock.spent.clear()
                dist.barrier()
                t0 = time.perf_counter()
                out, l_aux, _ = layer(x)
                t1 = time.perf_counter()
                forward_phases = sum(clock.spent.values())
                ((out * go).sum() + l_aux).backward()
                t2 = time.perf_counter()
                dist.barrier()
                wall = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                layer.zero_grad(set_to_none=True)
                x.grad = None
                if i == 0:
                    continue
                spent = dict(clock.spent)
                backward_phases = sum(spent.values()) - forward_phases
                spent["rest bwd"] = (t2 - t1) - backward_phases
                spent["glue"] = (t1 - t0) - forward_phases
                for phase in PHASES:
                    seen[s][phase].append(spent.get(phase, 0.0))
                seen[s]["step"].append(wall.item())
                seen[s]["forward"].append(t1 - t0)
    out = {}
    for s, times in seen.items():
        mine = {phase: statistics.median(v) for phase, v in times.items()}
        t = torch.tensor([mine[p] for p in (*PHASES, "forward")], dtype=torch.float64)
        dist.all_reduce(t)
        measured = dict(zip((*PHASES, "forward"), (t / dist.get_world_size()).tolist(), strict=True))
        measured["step"] = mine["step"]
        out[s] = {"measured": measured, "model": dict(cost_model.predict(s, sh, costs).parts),
                  "model_total": cost_model.predict(s, sh, costs).total}
    return out


def model_phases(parts: dict[str, float]) -> dict[str, float]:
    """The model's parts in this module's phases (module docstring)."""
    return {"gate": parts.get("gate", 0.0) + parts.get("agree", 0.0),
            "dispatch+combine": parts.get("dispatch+combine", 0.0),
            "exchanges": parts.get("exchanges", 0.0) + parts.get("a2a", 0.0),
            "experts": parts.get("experts", 0.0) + parts.get("esp", 0.0), "mp": parts.get("mp", 0.0)}


def _label(cfg: Config) -> str:
    return (f"tp{cfg.tp}xep{cfg.ep} E{cfg.experts} k{cfg.k} cf{cfg.capacity_factor} "
            f"M{cfg.hidden}/{cfg.ffn} S{cfg.tokens}")


LUMPS = {"compute": (("gate", "experts", "mp", "rest bwd"), ("gate", "experts", "mp")),
         "dispatch+combine": (("dispatch+combine",), ("dispatch+combine",)),
         "exchanges": (("fills", "exchanges"), ("exchanges",)), "glue": (("glue",), ())}
"""Measured phases and model phases that cover the same work, fwd + bwd (the backward's compute is one
lump, "rest bwd")."""


def lumps(v: dict) -> dict[str, tuple[float, float]]:
    """(measured, model) seconds per :data:`LUMPS` entry for one schedule's result."""
    m, p = v["measured"], model_phases(v["model"])
    return {name: (sum(m[x] for x in mine), sum(p[x] for x in theirs))
            for name, (mine, theirs) in LUMPS.items()}


def report(results: list[dict]) -> None:
    print(f"\n{'cell':<44}{'sched':<10}{'step':>7}{'model':>7}{'m/s':>6}  "
          + "  ".join(f"{p}" for p in PHASES) + "   (measured ms; model ms in brackets)")
    for r in results:
        for s, v in r["schedules"].items():
            m, p = v["measured"], model_phases(v["model"])
            cols = []
            for phase in PHASES:
                cols.append(f"{m[phase] * 1e3:.1f}" + (f"[{p[phase] * 1e3:.1f}]" if phase in p else ""))
            print(f"{r['label']:<44}{s:<10}{m['step'] * 1e3:>7.1f}{v['model_total'] * 1e3:>7.1f}"
                  f"{v['model_total'] / m['step']:>6.2f}  " + "  ".join(cols))
    print("\nfwd + bwd lumps, measured / model ms (model/measured):")
    for r in results:
        for s, v in r["schedules"].items():
            print(f"{r['label']:<44}{s:<10}" + "  ".join(f"{name} {a * 1e3:.1f}/{b * 1e3:.1f} "
                                                         f"({b / a if a else 0:.2f})"
                                                         for name, (a, b) in lumps(v).items()))


def _index(config: dict) -> int:
    """The cell's index in benchmarks.moe_sweep.cells()."""
    keys = ("tp", "ep", "experts", "k", "capacity_factor", "hidden", "ffn", "tokens")
    for i, cfg in enumerate(cells()):
        if all(getattr(cfg, key) == config[key] for key in keys):
            return i
    raise ValueError(f"cell {config} is not one of benchmarks.moe_sweep.cells()")


def accuracy(sweep_cells: list[dict]) -> dict[str, dict[str, list[float]]]:
    """{"diagnosed" | "validation": {schedule: [predicted / measured per cell]}} from a sweep's cells (its
    measured ms: the median over rounds of the slowest rank's step; tp 1 cells have no separate S1)."""
    out: dict[str, dict[str, list[float]]] = {"diagnosed": defaultdict(list), "validation": defaultdict(list)}
    for c in sweep_cells:
        group = "diagnosed" if _index(c["config"]) in DIAGNOSED else "validation"
        for s, predicted in c["predicted_ms"].items():
            out[group][s].append(predicted / c["ms"][s])
    return out


def print_accuracy(acc: dict[str, dict[str, list[float]]]) -> None:
    for group, per in acc.items():
        every = [r for rs in per.values() for r in rs]
        if not every:
            continue
        print(f"{group} cells, predicted / measured (min / median / max; within 25%):")
        for s, rs in [*per.items(), ("all", every)]:
            within = sum(0.75 <= r <= 1.25 for r in rs)
            print(f"  {s:<10} {len(rs):>3} cells  {min(rs):.2f} / {statistics.median(rs):.2f} / {max(rs):.2f}"
                  f"   {within}/{len(rs)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(map(str, DIAGNOSED)),
                   help="indices into benchmarks.moe_sweep.cells()")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--accuracy", metavar="SWEEP_JSON", default=None,
                   help="a moe_sweep --json file: predicted / measured per schedule, diagnosed vs validation")
    args = p.parse_args(argv)
    if args.accuracy:
        with open(args.accuracy) as f:
            print_accuracy(accuracy(json.load(f)["cells"]))
        return
    everything = cells()
    chosen = [everything[int(i)] for i in args.cells.split(",")]
    results = []
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with World(4, timeout=7200) as world:
        for cfg in chosen:
            res = world.run(_rank_phases, cfg, args.rounds, timeout=3600)[0]
            results.append({"label": _label(cfg), "schedules": res,
                            "load": " ".join(f"{v:.2f}" for v in os.getloadavg())})
            print(f"{_label(cfg)}: done, load {results[-1]['load']}", flush=True)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
