"""The simulator against real DeepSpeed pipeline runs on the emulated WAN: the calibration matrix.

    python -m benchmarks.atlas_calibration [--rtts 20,40] [--acts 256,1024] [--connections 1,8] [--steps 3]

Each cell is examples/atlas_pipeline.py (2 stages x 2 replicas, 4 micro-batches, fp32) started by
``deepspeed-atlas --no_ssh`` on two network namespaces joined by launch.net.wanemu (400 Mbit/s, the set
RTT, TCP buffers capped at 256 KiB): one launch per (RTT, activation size) times the same engine with
DeepSpeed's own p2p (stock) and with ATLAS at every (connections, sharing), visited in order and then
in reverse (a load that drifts during the launch weighs on every variant alike), ``--steps`` timed
steps per visit; a cell is the median over its 2 x ``--steps`` steps of the slowest rank's step time.
Needs root.

The prediction of a cell is launch.plan.simulate with ``schedule="deepspeed"`` (DeepSpeed's
instruction order, blocking gloo send/recv that rendezvous: launch/plan/deepspeed_schedule.py) on:

- the link: its rate (32 plain TCP streams, benchmarks.wan.link_rate) and, for the cell's way of
  sending, ``alpha + bytes / rate`` of one transfer after an idle gap and how long the send call
  takes to return, from blocking ping-pongs of 64 KiB and 2 MiB (one connection) or 1 and 4 MiB
  (striped) that the cell's own ranks run on the cell's own connections after its warm-up, just
  before its timed steps of the first pass, pair by pair, the other ranks at a barrier (the fit set,
  printed per cell). No pipeline step time enters it. The second pass's ping-pongs run with the ranks
  outside the pair computing their stage without pause (launch.net.pingpong.Beside) and are predicted
  beside them (``beside``): the CPU contention of a replica computing next to a transfer at full duty,
  an upper bound (measured: 1.5-3x pessimistic for one-connection cells, benchmarks/RESULTS.md), so not
  the prediction.
  The constants measured before the cells by separate processes (benchmarks.wan.link_constants,
  what ``python -m benchmarks.wan --pingpong 64,2048 --normal-priority`` measures on a user's link)
  are predicted beside them too (``--no-earlier-fit`` skips that): on this shared machine they
  drifted with the load (2.7 MB/s for one connection at 40 ms where the cells got 4.1, benchmarks/RESULTS.md);
- the cell's compute: each stage's median ForwardPass (+ LoadMicroBatch) and BackwardPass, and its
  ReduceGrads + OptimizerStep less the time in the step's all-reduces over the two stages, as the
  ranks timed them (inputs, like a profile: nothing is fitted);
- gloo's receiver-driven rendezvous (launch.plan.rendezvous): the WAN's one-way latency (half the
  median minrtt of the cell's WAN connections, ss) delays a transfer whose receive is posted late,
  and the step's all-reduces over the stages (gradient clipping's norm: DeepSpeed's default 1.0;
  as many as the ranks counted) are tiny messages to and from stage 0. ``no rdv`` is the
  prediction without these two terms, the step's measured time taken whole (the model before them).

Each cell also prints the kernel's view of its WAN sockets (ss: the advertised window snd_wnd and
the socket buffers rb/tb), the check that the run's window is the one the buffers cap it at. The
launched topology carries ``window_mb`` = the nodes' rmem/wmem maximum. Prints the table (measured,
predicted, error), whether each cell is within ±25% and whether the simulator ranks the variants of
each (RTT, size) as measured (pairs within 5% of each other in the measurement count as ties, and a
pair is misranked when the measurement separates it by more than 5% and the prediction orders it the
other way), the load (/proc/loadavg) before and after each launch, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RATE_MBIT, WINDOW_KIB, REPLICAS, MICRO_BATCHES = 400.0, 256, 2, 4
TOLERANCE, TIE = 0.25, 0.05
NODE_TIMEOUT = 600
# (hidden, rows) per activation size in KiB: rows x hidden x 4 bytes
SIZES = {256: (512, 128), 1024: (1024, 256), 64: (256, 64)}


def variants(connections: list[int], sharings: tuple[str, ...] = ("spatial", "temporal")) -> list[str]:
    return ["stock"] + [f"{k}:{mode}" for k in connections for mode in sharings]


def model(hidden: int) -> dict:
    return {"layers": 8, "hidden": hidden, "seq": 1, "micro_batch": 1, "dtype_bytes": 4,
            "global_batch": MICRO_BATCHES * REPLICAS, "pp": 2, "tp": 1, "dp": REPLICAS}


def measured(ranks: list[dict], variant: str) -> float:
    """Median over the timed steps of the slowest rank's seconds per step."""
    steps = zip(*(r["variants"][variant]["step_s"] for r in ranks), strict=True)
    return statistics.median(max(s) for s in steps)


def in_run_modes(ranks: list[dict], variants: list[str], key: str = "pingpong_s") -> dict[str, dict]:
    """Per variant, the link modes its prediction takes: the ping-pongs its own ranks ran just before
    its timed steps (launch.net.pingpong; ``key`` "pingpong_s" with the other ranks at a barrier,
    "pingpong_beside_s" beside their compute) for its own way of sending, the launch's other
    variants' for the rest (a k-connection variant below STRIPE_MIN_BYTES sends whole over one
    connection: the ``1`` mode)."""
    from launch.net.pingpong import combine

    own = {}
    for v in variants:
        k = 1 if v == "stock" else int(v.split(":")[0])
        pairs = [p for r in ranks for p in r["variants"][v]["link"][key]]
        own[v] = ("stock" if v == "stock" else str(k), combine(pairs, k))
    every = {key: mode for key, mode in own.values()}
    return {v: {**every, key: mode} for v, (key, mode) in own.items()}


def predict(ranks: list[dict], variant: str, act_bytes: int, link_Bps: float, modes: dict,
            rendezvous: bool = True) -> tuple[float, list, dict]:
    """The simulator's seconds per step for a cell, the compute inputs and the rendezvous terms it used
    (see the docstring).
    ``rendezvous`` False: the model before gloo's recv-ready notice and the step's all-reduces over the
    stages were modelled (launch.plan.rendezvous), the step's measured time taken whole, waits included
    (printed beside the prediction, for comparison)."""
    from launch.net.sockets import one_way_s
    from launch.plan.calibrated import LinkMode, WanSetting, compute_inputs, pipe_syncs, step_seconds

    ops = [(r["stage"], r["variants"][variant]["ops"]) for r in ranks]
    terms = {}
    if rendezvous:
        terms = {"one_way": one_way_s([c for r in ranks for c in r["variants"][variant]["link"]["tcp"]]),
                 "syncs": pipe_syncs([o for _, o in ops])}
    else:
        ops = [(s, {k: v for k, v in o.items() if not k.startswith("PipeSync")}) for s, o in ops]
    compute = compute_inputs(ops, 2)
    return step_seconds(compute, REPLICAS, MICRO_BATCHES, act_bytes, link_Bps,
                        LinkMode.from_measured(modes, variant, act_bytes), WanSetting.parse(variant),
                        **terms), compute, terms


def window_seen(ranks: list[dict], variant: str) -> dict:
    """The kernel's view of the WAN connections after the variant's ping-pongs (launch.net.sockets
    .tcp_info, from every rank's namespace): the largest advertised window and socket buffers of the
    connections that carried data, their congestion control."""
    conns = [c for r in ranks for c in r["variants"][variant]["link"]["tcp"]
             if c.get("bytes_acked", 0) > 2**20]
    if not conns:
        return {}
    return {"snd_wnd_kib": max(c.get("snd_wnd", 0) for c in conns) / 1024,
            "rb_kib": max(c.get("rb", 0) for c in conns) / 1024,
            "tb_kib": max(c.get("tb", 0) for c in conns) / 1024,
            "minrtt_ms": min(c.get("minrtt", float("inf")) for c in conns),
            "cc": sorted({c.get("cc", "?") for c in conns})}


def ranking_agrees(cells: list[dict]) -> list[str]:
    """Pairs of variants of one group the simulator orders against the measurement (ties: within 5%)."""
    bad = []
    for a, b in combinations(cells, 2):
        m = a["measured_s"] / b["measured_s"]
        p = a["predicted_s"] / b["predicted_s"]
        if abs(m - 1) > TIE and (m - 1) * (p - 1) < 0:
            bad.append(f"{a['variant']} vs {b['variant']}: measured {m:.2f}, predicted {p:.2f}")
    return bad


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtts", default="20,40", help="round trips in ms")
    ap.add_argument("--acts", default="256,1024", help=f"activation KiB per micro-batch, of {sorted(SIZES)}")
    ap.add_argument("--connections", default="1,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-earlier-fit", action="store_true",
                    help="skip the comparison with link constants measured by separate processes first")
    a = ap.parse_args(argv)
    rtts = [float(x) for x in a.rtts.split(",")]
    acts = [int(x) for x in a.acts.split(",")]
    conns = [int(x) for x in a.connections.split(",")]
    bad = [x for x in acts if x not in SIZES] + [x for x in conns if x < 1] + [x for x in rtts if x <= 0]
    if bad or a.steps < 1:
        raise ValueError(f"--acts in {sorted(SIZES)}, --connections >= 1, --rtts > 0, --steps >= 1; "
                         f"got {bad or a.steps}")
    result = run(rtts, acts, conns, a.steps, earlier_fit=not a.no_earlier_fit)
    if result is not None:
        report(result)


def run(rtts: list[float], acts: list[int], conns: list[int], steps: int,
        sharings: tuple[str, ...] = ("spatial", "temporal"), earlier_fit: bool = True,
        rate_s: float = 3.0) -> dict | None:
    """The matrix; ``earlier_fit``: also the link constants measured before the cells by separate
    processes (benchmarks.wan.link_constants), predicted beside the in-run ones for comparison;
    ``rate_s``: how long benchmarks.wan.link_rate's streams time the link's rate (without earlier_fit)."""
    from benchmarks.wan import link_constants, link_rate
    from launch.net import netns, two_dc
    from launch.net.wanemu import WanLink
    from launch.plan.socket_limits import host_window

    ok, reason = netns.available()
    if not ok:
        print(json.dumps({"bench": "atlas_calibration", "skipped": reason}))
        return None
    load, cells, links = [_load()], [], {}
    script = REPO / "examples" / "atlas_pipeline.py"
    for rtt_ms in rtts:
        with WanLink(rtt=rtt_ms / 1e3, rate=RATE_MBIT * 1e6 / 8) as link:
            two_dc.cap_buffers(link, WINDOW_KIB * 1024)
            # the link's rate (32 plain TCP streams); with earlier_fit, the separate processes' constants
            earlier = link_constants(link, connections=",".join(map(str, conns))) if earlier_fit else None
            rate = earlier["link_Bps"] if earlier else link_rate(link, rate_s)
            links[rtt_ms] = {"link_Bps": rate, "earlier": earlier}
            # the window for the launched plan: the nodes' limits (the prediction reads the run's own)
            window = min(host_window(lambda name, ns=ns: _read(ns, name), 1.0) for ns in (link.a, link.b))
            for kib in acts:
                hidden, rows = SIZES[kib]
                vs = variants(conns, sharings)
                args = ["--variants", ",".join(vs), "--steps", str(steps), "--passes", "2",
                        "--warmup", "1", "--hidden", str(hidden), "--micro-batch", str(rows)]
                topo = two_dc.topology(link, REPLICAS, rtt_ms, RATE_MBIT, window, model(hidden))
                with tempfile.TemporaryDirectory(prefix="atlas-cal-") as tmp:
                    ranks = two_dc.launch(link, topo, Path(tmp), script, args, timeout_s=NODE_TIMEOUT)
                modes = in_run_modes(ranks, vs)
                beside = in_run_modes(ranks, vs, "pingpong_beside_s")
                for v in vs:
                    pred, comp, terms = predict(ranks, v, rows * hidden * 4, links[rtt_ms]["link_Bps"],
                                                modes[v])
                    cell = {"rtt_ms": rtt_ms, "act_kib": kib, "variant": v, "measured_s": measured(ranks, v),
                            "predicted_s": pred, "compute": comp, "terms": terms, "link": modes[v],
                            "tcp": window_seen(ranks, v),
                            "beside_s": predict(ranks, v, rows * hidden * 4, links[rtt_ms]["link_Bps"],
                                                beside[v])[0],
                            "no_rendezvous_s": predict(ranks, v, rows * hidden * 4, links[rtt_ms]["link_Bps"],
                                                       modes[v], rendezvous=False)[0]}
                    if earlier:
                        cell["earlier_s"] = predict(ranks, v, rows * hidden * 4, earlier["link_Bps"],
                                                    earlier["modes"])[0]
                    cells.append(cell)
                load.append(_load())
            drops = {k: v for k, v in link.drops().items() if v and not k.startswith("tcp_retrans")}
            if drops:
                print(f"warning: the WAN emulator lost packets at {rtt_ms:g} ms: {drops}")
    return {"links": links, "cells": cells, "load": load}


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _read(ns, name: str) -> str | None:
    try:
        return ns.read("/proc/sys/" + name.replace(".", "/")).strip()
    except (OSError, RuntimeError):
        return None


def report(r: dict) -> None:
    from launch.plan.calibrated import choose

    cells = r["cells"]
    def modes_text(modes: dict) -> str:
        return ", ".join(f"{m}: {v['alpha_s'] * 1e3:.0f} ms + {v['Bps'] / 1e6:.1f} MB/s"
                         for m, v in modes.items())

    for rtt, c in r["links"].items():
        print(f"{rtt:g} ms: link {c['link_Bps'] / 1e6:.1f} MB/s (32 TCP streams)"
              + (f"; earlier fit (separate processes before the cells): {modes_text(c['earlier']['modes'])}"
                 if c["earlier"] else ""))
    earlier = any("earlier_s" in c for c in cells)
    print("the fit set of each cell: ping-pongs by its own ranks just before its first pass's timed steps, "
          "the other ranks at a barrier, t = alpha + bytes / rate; beside: the second pass's ping-pongs, the "
          "other ranks computing their stage without pause (launch.net.pingpong.Beside); tcp: the largest "
          "advertised window (snd_wnd) and socket buffers (rb/tb) of its WAN connections (ss)")
    print(f"{'RTT':>4} {'act':>6} {'variant':<12} {'measured':>9} {'predicted':>9} {'error':>7}  "
          + f"{'beside':>9} {'error':>7}  {'no rdv':>8} {'error':>7}  "
          + (f"{'earlier fit':>11} {'error':>7}  " if earlier else "")
          + f"{'F0/B0/F1/B1 ms':<16} {'this cell: alpha + rate':<22} tcp snd_wnd/rb/tb KiB")
    groups, within = {}, []
    for c in cells:
        err = c["predicted_s"] / c["measured_s"] - 1
        c["error"] = err
        within.append(abs(err) <= TOLERANCE)
        ms = "/".join(f"{getattr(c['compute'][s], k) * 1e3:.0f}" for s in (0, 1)
                      for k in ("forward", "backward"))
        key = "stock" if c["variant"] == "stock" else c["variant"].split(":")[0]
        own = c["link"][key]
        tcp = c["tcp"]
        print(f"{c['rtt_ms']:>4g} {c['act_kib']:>4}Ki {c['variant']:<12} {c['measured_s']:>8.3f}s "
              f"{c['predicted_s']:>8.3f}s {err:>+7.1%}  "
              f"{c['beside_s']:>8.3f}s {c['beside_s'] / c['measured_s'] - 1:>+7.1%}  "
              f"{c['no_rendezvous_s']:>7.3f}s {c['no_rendezvous_s'] / c['measured_s'] - 1:>+7.1%}  "
              + (f"{c['earlier_s']:>10.3f}s {c['earlier_s'] / c['measured_s'] - 1:>+7.1%}  "
                 if earlier else "")
              + f"{ms:<16} {own['alpha_s'] * 1e3:>3.0f} ms + {own['Bps'] / 1e6:>5.1f} MB/s      "
              + (f"{tcp['snd_wnd_kib']:.0f}/{tcp['rb_kib']:.0f}/{tcp['tb_kib']:.0f} {','.join(tcp['cc'])}"
                 if tcp else "-"))
        groups.setdefault((c["rtt_ms"], c["act_kib"]), []).append(c)
    choices = {}
    for (rtt, kib), g in groups.items():
        # what the planner would pick before running ATLAS: the stock run's compute, rendezvous terms
        # (one-way latency, the step's all-reduces over the stages) and the link's constants
        best, _ = choose(g[0]["compute"], REPLICAS, MICRO_BATCHES, kib * 1024, r["links"][rtt]["link_Bps"],
                         g[0]["link"], [c["variant"] for c in g], **g[0]["terms"])
        fastest = min(g, key=lambda c: c["measured_s"])
        by = {c["variant"]: c["measured_s"] for c in g}
        choices[f"{rtt:g}ms/{kib}KiB"] = {"chosen": best, "measured_best": fastest["variant"],
                                          "chosen_vs_best": round(by[best] / fastest["measured_s"], 3)}
    print("calibrated choice (stock compute, link constants) vs the measured fastest: " + ", ".join(
        f"{k} {v['chosen']} ({v['chosen_vs_best']:.2f}x the fastest, {v['measured_best']})"
        for k, v in choices.items()))
    misranked = {f"{k[0]:g}ms/{k[1]}KiB": ranking_agrees(v) for k, v in groups.items()}
    misranked = {k: v for k, v in misranked.items() if v}
    gains = {}
    for (rtt, kib), g in groups.items():
        by = {c["variant"]: c for c in g}
        for k in sorted({v.split(":")[0] for v in by if v != "stock"}):
            sp, tp = by.get(f"{k}:spatial"), by.get(f"{k}:temporal")
            if sp and tp:
                gains[f"{rtt:g}ms/{kib}KiB/{k}conn"] = {
                    "measured": round(sp["measured_s"] / tp["measured_s"], 3),
                    "predicted": round(sp["predicted_s"] / tp["predicted_s"], 3)}
    before = sum(abs(c["no_rendezvous_s"] / c["measured_s"] - 1) <= TOLERANCE for c in cells)
    print(f"within ±{TOLERANCE:.0%}: {sum(within)}/{len(within)} (without the rendezvous terms: {before}); "
          f"rankings: {misranked if misranked else 'same in every group'}")
    print("temporal gain (spatial s / temporal s): " + ", ".join(
        f"{k} measured {v['measured']:.2f}x predicted {v['predicted']:.2f}x" for k, v in gains.items()))
    print("load (/proc/loadavg 1/5/15 min) before the matrix and after each launch: "
          + "; ".join(" ".join(f"{x:.1f}" for x in load) for load in r["load"]))
    print(json.dumps({"bench": "atlas_calibration", "cells": [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()
         if k not in ("compute", "link")}
        for c in cells],
        "within": sum(within), "of": len(within), "misranked": misranked, "temporal_gain": gains,
        "choices": choices,
        "links": {str(k): {"link_MBps": round(v["link_Bps"] / 1e6, 1)} for k, v in r["links"].items()},
        "loadavg": r["load"]}))


if __name__ == "__main__":
    main()
