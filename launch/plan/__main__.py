"""``python -m launch.plan TOPOLOGY``: ATLAS's plan against the baselines on the same topology.

Prints the plan (launch.plan.placement.render); a table with every baseline's best layout with the
freedom of its own system (launch.plan.baselines), iteration time, tokens/s, GPU utilisation, WAN bytes
per iteration, ATLAS's speed-up over it and the limits the real system keeps; the same table on exactly
ATLAS's GPUs; ATLAS's gain over the best baseline, anywhere and on its GPUs, one mechanism at a time
(launch.plan.gain); any warnings about this machine's TCP settings (they never change the plan); and
ends with one JSON line::

    {"iteration_s": ..., "tokens_per_s": ..., "utilisation": ..., "wan_bytes": ...,
     "baselines": {"deepspeed": s, "megatron": s, "varuna": s, "dp-wan": s}, "speedups": {...},
     "best_baseline": ..., "speedup_vs_best_baseline": ..., "speedup_vs_best_baseline_same_gpus": ...,
     "gain_steps": [...], "gain_steps_same_gpus": [...], "layout": {...}, ...}

``--sharing`` is spatial unless asked (launch.plan.placement.SHARINGS: temporal sharing never paid in the
calibration matrix, so ``temporal``/``auto`` are opt-ins and the decomposition's sharing step is 1.00x
by default). ``--no-baselines`` skips the baselines and the decomposition (most of the run time).
A baseline with no layout that fits (or that cannot span the DCs it must span) shows as null.
``--timeline FILE.png`` draws ATLAS's iteration, one row per pipeline-stage replica
(launch.plan.timeline); ``--trace FILE.json`` writes the same ops as a Chrome trace. ``--bubbletea`` adds
the utilisation with BubbleTea's prefill packed into the bubbles (launch.bubbletea.simulate) to the
output and ``"utilisation_bubbletea"`` to the JSON line, and draws the prefill into the timeline.
"""

from __future__ import annotations

import argparse
import json
import sys

from commweave import values
from launch.plan import baselines, gain, inputs
from launch.plan import topology as topology_mod
from launch.plan.estimate import ModelSpec, stage_layers
from launch.plan.placement import (
    DEFAULT_ENGINE,
    DEFAULT_SHARING,
    ENGINES,
    SHARINGS,
    UNVALIDATED,
    atlas_layouts,
    choose,
    load_model,
    plan_of,
    render,
    sharing_modes,
)
from launch.plan.search import Choice, best
from launch.plan.socket_limits import DEFAULT_WINDOW, tcp_advice
from launch.plan.timeline import Op, draw, write_trace
from launch.plan.topology import Topology


def describe(c: Choice) -> str:
    lay = c.layout
    dcs = sorted({d for stage in lay.dc for d in stage})
    split = "even" if list(lay.stage_layers) == stage_layers(sum(lay.stage_layers), lay.pp) else \
        "/".join(map(str, lay.stage_layers))
    return f"pp={lay.pp} tp={lay.tp} dp={lay.dp} ({lay.gpus} GPUs; {'+'.join(dcs)}; layers {split})"


def table(model: ModelSpec, atlas: Choice, others: dict[str, Choice | None],
          across: Choice | None = None, title: str = "") -> str:
    """One row per system with the limit its real system keeps; ``across``: ATLAS's best layout that
    spans data centers, shown when its plan keeps to one DC (what crossing would cost with ATLAS's own
    WAN mechanisms)."""
    tokens = model.global_batch * model.seq
    rows = [("ATLAS", atlas, "")] + ([("ATLAS, across DCs", across, "")] if across else [])
    rows += [(baselines.NAMES[k], c, baselines.LIMITS[k]) for k, c in others.items()]
    head = (f"  {'system':<18} {'layout':<62} {'schedule':<9} {'iteration s':>11} {'tokens/s':>10} "
            f"{'GPU util':>8} {'WAN GB':>7} {'ATLAS x':>7}  held back by (the real system's limits)")
    lines = [title or "baselines (same topology, same simulator, each with its own system's freedom and its "
                      "engine's schedule; WAN GB = bytes over the WAN per iteration)", head]
    for name, c, limit in rows:
        if c is None:
            dash = f"{'-':>11} {'-':>10} {'-':>8} {'-':>7} {'-':>7}"
            lines.append(f"  {name:<18} {'no layout fits':<62} {'':<9} {dash}  {limit}")
            continue
        r = c.result
        lines.append(f"  {name:<18} {describe(c):<62} {c.layout.schedule:<9} {r.iteration:>11.4g} "
                     f"{tokens / r.iteration:>10.4g} "
                     f"{100 * r.utilisation:>7.0f}% {r.wan_bytes / 1e9:>7.4g} "
                     f"{r.iteration / atlas.result.iteration:>6.2f}x  {limit}")
    return "\n".join(lines)


def decomposition(steps: list[gain.Step], where: str) -> str:
    lines = [f"ATLAS's gain over the best baseline {where}, one mechanism at a time (launch.plan.gain: "
             "each step the best layout with the mechanisms so far; the ratios multiply to the total)"]
    for st in steps:
        t = f"{st.seconds:.4g} s" if st.seconds is not None else "no layout fits"
        r = f"{st.ratio:.2f}x" if st.ratio is not None else ""
        lines.append(f"  {st.label:<44} {t:>12} {r:>7}")
    known = [st.seconds for st in steps if st.seconds is not None]
    if len(known) == len(steps) and steps:
        lines.append(f"  {'total':<44} {'':>12} {steps[0].seconds / steps[-1].seconds:>6.2f}x")
    return "\n".join(lines)


def _fastest(choices: dict[str, Choice | None]) -> tuple[str | None, float | None]:
    top = gain.best_of(choices)
    return (top[0], top[1].result.iteration) if top else (None, None)


def summary(topo: Topology, model: ModelSpec, atlas: Choice, others: dict[str, Choice | None],
            across: Choice | None = None, same: dict[str, Choice | None] | None = None,
            steps: list[gain.Step] = (), same_steps: list[gain.Step] = (),
            measured: inputs.Measured | None = None) -> dict:
    r, lay = atlas.result, atlas.layout
    times = {k: (c.result.iteration if c else None) for k, c in others.items()}
    name, fastest = _fastest(others)
    same_times = {k: (c.result.iteration if c else None) for k, c in (same or {}).items()}
    same_name, same_fastest = _fastest(same or {})
    return {
        "topology": topo.source,
        "iteration_s": r.iteration,
        "tokens_per_s": model.global_batch * model.seq / r.iteration,
        "utilisation": r.utilisation,
        "wan_bytes": r.wan_bytes,
        "layout": {"pp": lay.pp, "tp": lay.tp, "dp": lay.dp, "stage_dc": [s[0] for s in lay.dc],
                   "stage_layers": list(lay.stage_layers), "connections": lay.connections,
                   "sharing": lay.sharing},
        "lower_bound_s": atlas.bound,
        "candidates": atlas.candidates,
        "simulated": atlas.simulated,
        "baselines": times,
        "speedups": {k: (t / r.iteration if t else None) for k, t in times.items()},
        "best_baseline": name,
        "speedup_vs_best_baseline": fastest / r.iteration if fastest else None,
        "baselines_same_gpus": same_times,
        "best_baseline_same_gpus": same_name,
        "speedup_vs_best_baseline_same_gpus": same_fastest / r.iteration if same_fastest else None,
        "gain_steps": [{"step": st.label, "seconds": st.seconds, "ratio": st.ratio} for st in steps],
        "gain_steps_same_gpus": [{"step": st.label, "seconds": st.seconds, "ratio": st.ratio}
                                 for st in same_steps],
        "atlas_across_dcs_s": across.result.iteration if across else None,
        "engine": lay.schedule,
        "wan_windows": [{"link": [w.a, w.b], "window_mb": w.bytes / 2**20, "source": w.source,
                         "from": w.where} for w in inputs.windows(topo, measured or {}, DEFAULT_WINDOW)],
    }


def labels(atlas: Choice) -> dict[tuple[int, int], str]:
    lay = atlas.layout
    return {(s, d): f"{lay.dc[s][d]} s{s} r{d}" for s in range(lay.pp) for d in range(lay.dp)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.plan",
                                 description="ATLAS's plan for a topology, against the baselines")
    ap.add_argument("topology", help="the ATLAS topology file (JSON)")
    ap.add_argument("--atlas-model", default=None, help="JSON with the model section (else the topology's)")
    ap.add_argument("--wan-connections", type=int, default=None,
                    help="fix the TCP connections per WAN pair (1..64; default: the planner chooses)")
    ap.add_argument("--sharing", default=DEFAULT_SHARING, metavar="|".join(SHARINGS),
                    help="how DP replicas share a WAN link: at once (spatial, the default), taking turns "
                         "(temporal), or the faster by the simulator (auto); temporal and auto are "
                         f"{UNVALIDATED}")
    ap.add_argument("--engine", default=DEFAULT_ENGINE, metavar="|".join(ENGINES),
                    help="the training engine ATLAS runs on, whose call order ranks its layouts (default "
                         "deepspeed: what deepspeed-atlas launches; megatron: a Megatron-LM script with "
                         "launch.run.runtime.enable_megatron)")
    ap.add_argument("--link", action="append", metavar="A:B=FILE",
                    help="the TCP window of the WAN link A-B as measured on it (FILE: python -m "
                         "benchmarks.wan --json FILE); repeat per link; else the topology's window_mb, else "
                         "Linux's default")
    ap.add_argument("--timeline", metavar="FILE.png", help="draw ATLAS's iteration, one row per GPU")
    ap.add_argument("--timeline-span", metavar="START:END", type=_span, default=None,
                    help="draw only this part of the iteration, in seconds (default: all of it)")
    ap.add_argument("--trace", metavar="FILE.json", help="write ATLAS's iteration as a Chrome trace")
    ap.add_argument("--bubbletea", action="store_true",
                    help="add the GPU utilisation with BubbleTea's prefill in the bubbles (launch.bubbletea)")
    ap.add_argument("--no-baselines", action="store_true",
                    help="plan only: skip the baselines and the gain decomposition (most of the run time)")
    ap.add_argument("--json", action="store_true",
                    help="print only the plan as JSON (what the launcher exports)")
    args = ap.parse_args(argv)
    try:
        # the destinations first: a missing directory used to fail after the whole search
        for flag, path in (("--timeline", args.timeline), ("--trace", args.trace)):
            if path is not None:
                values.write_target(path, flag)
        if args.timeline:
            _need_matplotlib()
        topo, measured = inputs.apply_links(topology_mod.load(args.topology), args.link)
        model = load_model(topo, args.atlas_model)
        sharings = sharing_modes(args.sharing, "--sharing")
        values.choice(args.engine, "--engine", ENGINES)
        atlas = choose(topo, model, args.wan_connections, args.sharing, DEFAULT_WINDOW, args.engine)
        plan = plan_of(topo, model, atlas, DEFAULT_WINDOW)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.to_json())
        return 0
    others, same, steps, same_steps = {}, {}, [], []
    if not args.no_baselines:
        others = gain.compare(topo, model, DEFAULT_WINDOW)
        same, same_steps = gain.same_gpus(topo, model, plan, atlas, DEFAULT_WINDOW)
        steps = gain.decompose(topo, model, atlas, others, DEFAULT_WINDOW)
    across = None
    if not args.no_baselines and not atlas.layout.crosses_wan and len(topo.datacenters) > 1:
        spanning = (lay for lay in atlas_layouts(topo, model, DEFAULT_WINDOW, args.wan_connections,
                                                 engine=args.engine) if lay.crosses_wan)
        across = best(topo, model, spanning, DEFAULT_WINDOW, sharings)
    print(render(plan, topo, model))
    print("\n".join(inputs.render(topo, measured, DEFAULT_WINDOW)))
    if not args.no_baselines:
        print(table(model, atlas, others, across))
        print(table(model, atlas, same, title=f"the baselines on ATLAS's own {plan.world_size} GPUs (the "
                                              "hosts and slots of its plan, every one used)"))
        print(decomposition(steps, "anywhere"))
        print(decomposition(same_steps, f"on ATLAS's {plan.world_size} GPUs"))
    links = [topo.link(plan.stage_dc[s], plan.stage_dc[s + 1]) for s in plan.wan_boundaries()]
    advice = tcp_advice(links, plan.wan_flows)
    if advice:
        print(f"warning: this machine's TCP settings (reported only: the plan assumes a window of "
              f"{DEFAULT_WINDOW / 2**20:g} MiB per WAN connection, or the topology's window_mb, on the "
              "hosts):", file=sys.stderr)
        for line in advice:
            print(f"  {line}", file=sys.stderr)
    r = atlas.result
    title = (f"ATLAS on {topo.source}: pp={plan.pp} tp={plan.tp} dp={plan.dp}, "
             f"{r.iteration:.3g} s per iteration, GPU utilisation {100 * r.utilisation:.0f}%")
    ops = list(atlas.result.ops)   # the iteration's ops (launch.plan.timeline.Op)
    out = summary(topo, model, atlas, others, across, same, steps, same_steps, measured)
    if args.bubbletea:
        from launch.bubbletea.simulate import for_plan, render_line

        bt = for_plan(topo, model, plan, DEFAULT_WINDOW, engine=args.engine)
        print(render_line(bt))
        ops += [Op(*p.lane, "prefill", p.start, p.end) for p in bt.packing.placements]
        title += f", {100 * bt.utilisation:.0f}% with BubbleTea's prefill"
        out["utilisation_bubbletea"] = bt.utilisation
        out["prefill_tokens_per_s"] = bt.prefill_tokens_per_s
    if args.timeline:
        if args.timeline_span:
            title += f"; {args.timeline_span[0]:g}-{args.timeline_span[1]:g} s shown"
        draw(args.timeline, ops, atlas.result.iteration, title, labels(atlas), window=args.timeline_span)
        print(f"timeline: {args.timeline}")
    if args.trace:
        write_trace(args.trace, ops, labels(atlas))
        print(f"trace: {args.trace}")
    print(json.dumps(out))
    return 0


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--timeline needs matplotlib (a commweave requirement): "
                         "pip install matplotlib") from None


def _span(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--timeline-span {text!r}: use START:END in seconds, "
                                         "e.g. 0:2.5") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"--timeline-span {text!r}: need 0 <= START < END")
    return a, b


if __name__ == "__main__":
    sys.exit(main())
