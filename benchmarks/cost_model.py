"""The cost model out of sample on this machine: calibrate from the microbenchmarks alone, then measure
every (U, C, order) candidate ``auto`` chooses among and compare the model's ranking with the measured one:

    flock /tmp/commweave-bench.lock python -m benchmarks.cost_model --worlds 4 8

Per world of P gloo ranks (one thread each, as benchmarks.attention runs them): first the calibration
(megatron_patches.calibrate's microbenchmarks on the same P ranks: ring exchange, the three collectives
per group size, the kernel per block size, the overlap at ring attention's own step
(calibrate.ring_step), and the host work of each plan's code path on 16 rows per rank (host.py); nothing
of the attention runs below goes into it), then the candidates' causal attention forward + backward
(wallfacer_attention with ulysses_size U, team size C and the slot order; MHA, fp32, N = P x
--seq-per-rank tokens) in --reps + 1 rounds (the first dropped), each round running the candidates in a
rotated order and then in its reverse (a linear load drift adds the same to each), then the model's
seconds for each (choice.plan_s with the measured profile, one node). Both clocks: wall (median over
rounds of the slowest rank) and CPU (median of the mean over ranks of each rank's process CPU time), each
against the profile calibrated in that clock.

Printed per world and clock: candidate, measured ms and its spread (interquartile range over rounds, %
of the median), predicted ms and the host share of it, predicted/measured, measured and predicted rank;
Kendall's tau-b twice: without the tie rule (the medians' order, every difference counts) and with it
(a pair is a measured tie when its paired per-round ratios' quartiles lie on both sides of 1:
tied_pairs); ties in the model (two orders that are the same links on one node) count as ties in both;
the model's pick, how far its measured time is from the measured best and whether the two are a
measured tie. The last line is JSON of the same.

The calibration also measures exactly every block call the candidates make (choice.call_shapes: each
plan's rectangles and diagonal blocks at its own heads per call, Profile.calls), so that no plan's
kernels are priced off square blocks of other head counts.

Kernel drift. The calibration and the candidates run minutes apart, and on a shared machine the seconds
of a FLOP change in between (the same block call measured 15-25% apart within ten minutes, in CPU time
too). So each round also times every one of those exact calls once with the calibration's own
microbenchmark, and kernel_drift gives their seconds over their calibrated price; the "at drift"
column is the model with every kernel call that median factor longer (kernels_scaled): a re-measurement
of the calibration's kernels, not of any candidate. Both are printed; the bar is judged on the plain
prediction.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace


def _sign(a: float, b: float, rel: float) -> int:
    return 0 if abs(a - b) <= rel * max(abs(a), abs(b)) else (1 if a > b else -1)


def kendall_tau(x: list[float], y: list[float], rel: float = 1e-9, ties=None) -> float:
    """Kendall's tau-b of the orders of x and y; values within ``rel`` of each other are ties, and so is
    every pair (i, j) in ``ties`` (measured ties, in y: tied_pairs)."""
    ties = set() if ties is None else ties
    conc = disc = tie_x = tie_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx = _sign(x[i], x[j], rel)
            dy = 0 if (i, j) in ties else _sign(y[i], y[j], rel)
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tie_x += 1
            elif dy == 0:
                tie_y += 1
            elif dx == dy:
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tie_x) * (conc + disc + tie_y))
    return (conc - disc) / denom if denom else 1.0


def tied_pairs(series: list[list[float]]) -> set[tuple[int, int]]:
    """The tie rule: candidates i < j are a measured tie when the paired per-round ratios t_i / t_j (the
    same round: the same load) have their lower and upper quartiles (statistics.quantiles, inclusive) on
    both sides of 1 (or on it), i.e. neither was faster in about three rounds of four. With 5 rounds: a
    pair is resolved only when one candidate was faster in at least 4 of them."""
    out = set()
    for i in range(len(series)):
        for j in range(i + 1, len(series)):
            r = [a / b for a, b in zip(series[i], series[j], strict=True)]
            q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else (r[0],) * 3
            if q1 <= 1 <= q3:
                out.add((i, j))
    return out


def name(u: int, c: int, order: str) -> str:
    return f"U={u} C={c}" + (f" {order}" if c > 1 else "")


def _measure(s: int, b: int, h: int, d: int, cands: list, rounds: int, calls: list) -> dict:
    """On every rank: each candidate's (wall, CPU) seconds per round. A round runs the candidates in a
    rotated order and then in its reverse (A B C … C B A, each round starting one later), and a
    candidate's value is the mean of its two runs: a load that drifts linearly over the round adds the
    same to every candidate. Wall: barrier to barrier (the slowest rank); CPU: this process's. Then the
    reference kernel calls (kernel_drift: ``calls``, the calibration's exact calls), timed as the
    calibration times them, under "_refs"."""
    import torch
    import torch.distributed as dist

    from megatron_patches.calibrate import _timed, call_bench
    from megatron_patches.host import plan_key, plan_steps

    world = dist.get_world_size()
    steps = plan_steps(s, b, h, d, cands)
    names = [plan_key(world, *c) for c in cands]
    out = {n: {"times": [], "cpu": []} for n in names}
    dev = torch.device("cpu")
    refs = {tuple(c): call_bench(c, d, torch.float32, dev) for c in calls}
    out["_refs"] = {c: {"times": [], "cpu": []} for c in refs}
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        got = {n: [] for n in names}
        for n in order + order[::-1]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            steps[n]()
            cpu = time.process_time() - c
            dist.barrier()
            got[n].append((time.perf_counter() - t, cpu))
        for n, ts in got.items():
            out[n]["times"].append(statistics.mean(w for w, _ in ts))
            out[n]["cpu"].append(statistics.mean(c for _, c in ts))
        for c, fn in refs.items():
            ((wall, cpu_s),) = _timed(fn, 1, dev, warm=False)
            out["_refs"][c]["times"].append(wall)
            out["_refs"][c]["cpu"].append(cpu_s)
    return {"_refs": out["_refs"], **{name(*c): out[n] for c, n in zip(cands, names, strict=True)}}


def kernel_drift(refs: dict, prof, d: int) -> list[float]:
    """Per round, the reference calls' measured seconds over their price in ``prof``: how much slower
    (> 1) or faster the kernels ran while the candidates were measured than while they were calibrated.

    ``refs``: (curve, rows, keys, b·h heads) -> the round's seconds of that block call (the calibration's
    own microbenchmark, calibrate.call_bench, in the profile's clock; the calls the candidates make, which
    the calibration measured exactly). On a shared machine
    the CPU seconds of a FLOP change with what else runs (caches, memory bandwidth, the hypervisor), and
    the calibration and the candidates run minutes apart: a model priced at the calibration's speed is
    off by this factor on every kernel call, whatever its structure. Nothing here is a candidate's time."""
    from megatron_patches.placement import Topology

    topo = Topology.from_profile(prof)
    price = sum(topo.call_s(rows, keys, c.endswith("causal"), heads, d, c.startswith("bwd"))
                for c, rows, keys, heads in refs)
    return [sum(ts) / price for ts in zip(*refs.values(), strict=True)]


def kernels_scaled(prof, factor: float):
    """``prof`` with every attention call ``factor`` times as long (each curve's TFLOP/s / factor, each
    exact call's seconds x factor); links, collectives, host work and memory traffic as measured."""
    from megatron_patches.profile import Curve, Kernel

    att = {k: Kernel({h: Curve(tuple((w, t / factor) for w, t in c.points)) for h, c in kern.curves.items()})
           for k, kern in prof.attention.items()}
    return replace(prof, attention=att, calls={k: t * factor for k, t in prof.calls.items()})


def world_table(world: int, args, calib_cfg: dict) -> dict:
    from commweave.world import World
    from megatron_patches.calibrate import calibrate, problem
    from megatron_patches.choice import candidates, plan_s
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    s, b, h, d = args.seq_per_rank, args.batch, args.heads, args.head_dim
    sh, nodes = Shard(s, b, h, h, d, 4, 4), [0] * world
    cands = candidates(world, sh, nodes)
    prob = problem(world, s, h, d, "float32", b)  # every plan's exact calls; the overlap at ring's step
    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    t0 = time.time()
    with World(world, timeout=3600, start_timeout=900) as w:
        profiles = calibrate({**calib_cfg, "ranks": world, **prob}, world=w)
        t1 = time.time()
        per_rank = w.run(_measure, s, b, h, d, cands, args.reps + 1, prob["calls"], timeout=3600)
    load1 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out = {"load": [load0, load1], "calibration_s": t1 - t0, "candidates_s": time.time() - t1,
           "profiles": {k: p.to_json() for k, p in profiles.items()}}
    for clock, prof in profiles.items():
        topo = Topology.from_profile(prof, world)
        key, pick = ("times", max) if clock == "wall" else ("cpu", statistics.mean)
        refs = {c: [pick(r["_refs"][c][key][i] for r in per_rank) for i in range(1, args.reps + 1)]
                for c in per_rank[0]["_refs"]}
        drift = kernel_drift(refs, prof, d)
        at_drift = Topology.from_profile(kernels_scaled(prof, statistics.median(drift)), world)
        rows, series = [], []
        for u, c, order in cands:
            n = name(u, c, order)
            if clock == "wall":
                ser = [max(r[n]["times"][i] for r in per_rank) for i in range(1, args.reps + 1)]
            else:
                ser = [statistics.mean(r[n]["cpu"][i] for r in per_rank) for i in range(1, args.reps + 1)]
            series.append(ser)
            q1, _, q3 = statistics.quantiles(ser, n=4, method="inclusive")
            rows.append({"name": n, "measured_ms": 1e3 * statistics.median(ser),
                         "series_ms": [1e3 * t for t in ser],  # per round, for paired ratios afterwards
                         "iqr_pct": 100 * (q3 - q1) / statistics.median(ser),
                         "predicted_ms": 1e3 * plan_s(world, sh, nodes, topo, u, c, order),
                         "drift_predicted_ms": 1e3 * plan_s(world, sh, nodes, at_drift, u, c, order),
                         "host_ms": 1e3 * prof.host_s(world, u, c, order),
                         "memory_ms": 1e3 * prof.memory_s(world, u, c, order, s, b * h * d * 4)})
        out[clock] = {**summarize(rows, tied_pairs(series)), "kernel_drift": drift}
        print_table(world, clock, out[clock], args, load0, load1)
    return out


def summarize(rows: list[dict], ties: set | None = None) -> dict:
    """Ranks, Kendall's tau-b without the tie rule (every measured difference counts) and with it
    (``ties``: tied_pairs), the model's pick and the measured best, and whether they are a measured tie."""
    ties = set() if ties is None else ties
    meas, pred = [r["measured_ms"] for r in rows], [r["predicted_ms"] for r in rows]
    for key, vals in (("measured_rank", meas), ("predicted_rank", pred)):
        for i, r in enumerate(sorted(range(len(rows)), key=lambda i: vals[i])):
            rows[r][key] = i + 1
    pick = min(range(len(rows)), key=lambda i: pred[i])
    best = meas.index(min(meas))
    bare = [p - r.get("memory_ms", 0.0) for p, r in zip(pred, rows, strict=True)]
    at_drift = [r.get("drift_predicted_ms", p) for p, r in zip(pred, rows, strict=True)]
    return {"rows": rows, "kendall_tau": kendall_tau(pred, meas),
            "kendall_tau_drift": kendall_tau(at_drift, meas),
            "kendall_tau_ties_drift": kendall_tau(at_drift, meas, ties=ties),
            "kendall_tau_without_memory": kendall_tau(bare, meas),
            "kendall_tau_ties_without_memory": kendall_tau(bare, meas, ties=ties),
            "kendall_tau_ties": kendall_tau(pred, meas, ties=ties),
            "tied": sorted([rows[i]["name"], rows[j]["name"]] for i, j in ties),
            "pick": rows[pick]["name"], "best": rows[best]["name"], "pick_over_best": meas[pick] / meas[best],
            "pick_tied_with_best": pick == best or (min(pick, best), max(pick, best)) in ties}


def print_table(world: int, clock: str, t: dict, args, load0: str, load1: str) -> None:
    print(f"\nP = {world}, {world * args.seq_per_rank} tokens, "
          f"{args.heads} heads x {args.head_dim}, fp32, causal; "
          f"{clock} clock, median of {args.reps} interleaved rounds; load {load0} -> {load1}")
    print(f"{'candidate':<22}{'measured ms':>12}{'IQR %':>7}{'predicted ms':>13}{'host ms':>8}{'mem ms':>8}"
          f"{'pred/meas':>10}{'at drift':>9}{'/meas':>6}{'rank meas':>10}{'rank pred':>10}")
    for r in t["rows"]:
        at = r.get("drift_predicted_ms", r["predicted_ms"])
        print(f"{r['name']:<22}{r['measured_ms']:>12.1f}{r['iqr_pct']:>7.1f}{r['predicted_ms']:>13.1f}"
              f"{r['host_ms']:>8.1f}{r.get('memory_ms', 0.0):>8.1f}"
              f"{r['predicted_ms'] / r['measured_ms']:>10.2f}{at:>9.1f}{at / r['measured_ms']:>6.2f}"
              f"{r['measured_rank']:>10}{r['predicted_rank']:>10}")
    drift = t.get("kernel_drift")
    if drift:
        print(f"kernel drift (the reference calls while the candidates ran / their calibrated price): median "
              f"{statistics.median(drift):.3f}, rounds {' '.join(f'{x:.3f}' for x in drift)}; "
              f"'at drift': the model with every kernel call that much longer; tau-b at drift "
              f"{t['kendall_tau_drift']:.2f} / {t['kendall_tau_ties_drift']:.2f} with measured ties")
    print(f"Kendall tau-b {t['kendall_tau']:.2f} (every measured difference counts), "
          f"{t['kendall_tau_ties']:.2f} with measured ties ({len(t['tied'])}: "
          f"{'; '.join(' = '.join(p) for p in t['tied']) or 'none'}); without the memory term "
          f"{t['kendall_tau_without_memory']:.2f} / {t['kendall_tau_ties_without_memory']:.2f}; "
          f"model's pick {t['pick']}, "
          f"measured best {t['best']}; the pick's measured time / the best's: {t['pick_over_best']:.3f}"
          f"{' (a measured tie)' if t['pick_tied_with_best'] and t['pick'] != t['best'] else ''}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-per-rank", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calib-reps", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096],
                   help="calibration block sizes")
    p.add_argument("--sizes-log2", type=int, nargs=2, default=[12, 23])
    p.add_argument("--json-out", default=None, help="also write the JSON (profiles included) here")
    args = p.parse_args(argv)
    from megatron_patches.calibrate import config

    # The kernel at every head count a candidate's calls have: h/U for each Ulysses size U.
    heads = sorted({args.heads // u for u in range(1, min(args.heads, max(args.worlds)) + 1)
                    if args.heads % u == 0})
    # and up to the largest call: U·C·s rows of h/U heads (a team of C members' rows, U groups' each), so
    # rows x heads <= C_max·s·h with C_max = sqrt(P) the largest team.
    big = int(max(args.worlds) ** 0.5) * args.seq_per_rank * args.heads
    calib = config(["--out", os.devnull, "--reps", str(args.calib_reps), "--rows", *map(str, args.rows),
                    "--sizes-log2", *map(str, args.sizes_log2), "--heads", *map(str, heads),
                    "--head-dim", str(args.head_dim), "--max-rows-x-heads", str(big)])
    calib["command"] = "python -m benchmarks.cost_model " + " ".join(sys.argv[1:] if argv is None else argv)
    out = {f"P{w}": world_table(w, args, calib) for w in args.worlds}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    line = {k: {clock: {m: v[clock][m] for m in ("kendall_tau", "kendall_tau_ties", "kendall_tau_drift",
                                                 "pick", "best", "pick_over_best", "pick_tied_with_best")}
                for clock in ("wall", "cpu")} for k, v in out.items()}
    print(json.dumps(line))
    return out


if __name__ == "__main__":
    main()
