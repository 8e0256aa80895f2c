"""The cost model out of sample on this machine: calibrate from the microbenchmarks alone, then measure
every (U, C, order) candidate ``auto`` chooses among and compare the model's ranking with the measured one:

    flock /tmp/commweave-bench.lock python -m benchmarks.cost_model --worlds 4 8

Per world of P gloo ranks (one thread each, as benchmarks.attention runs them): first the calibration
(megatron_patches.calibrate's microbenchmarks on the same P ranks: ring exchange, the three collectives
per group size, the kernel per block size, overlap; nothing of the attention runs below goes into it),
then the candidates' causal attention forward + backward (wallfacer_attention with ulysses_size U, team
size C and the slot order; MHA, fp32, N = P x --seq-per-rank tokens), interleaved rounds
(benchmarks.rounds), then the model's seconds for each (choice.plan_s with the measured profile, one
node). Both clocks: wall (median over rounds of the slowest rank) and CPU (median of the mean over ranks
of each rank's process CPU time), each against the profile calibrated in that clock.

Printed per world and clock: candidate, measured ms, predicted ms, predicted/measured, measured and
predicted rank; Kendall's tau-b of the two orders (ties in the model, e.g. two orders that are the
same links on one node, count as ties); the model's pick and how far its measured time is from the
measured best. The last line is JSON of the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

from benchmarks.rounds import interleaved


def kendall_tau(x: list[float], y: list[float], rel: float = 1e-9) -> float:
    """Kendall's tau-b; values within ``rel`` of each other are ties."""
    def sign(a: float, b: float) -> int:
        return 0 if abs(a - b) <= rel * max(abs(a), abs(b)) else (1 if a > b else -1)

    conc = disc = tie_x = tie_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = sign(x[i], x[j]), sign(y[i], y[j])
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


def name(u: int, c: int, order: str) -> str:
    return f"U={u} C={c}" + (f" {order}" if c > 1 else "")


def _measure(s: int, b: int, h: int, d: int, cands: list, rounds: int) -> dict:
    """On every rank: each candidate's interleaved (wall, CPU) seconds (benchmarks.rounds)."""
    import torch.distributed as dist

    from megatron_patches.layout import rank_chunks
    from megatron_patches.placement import ORDERS
    from megatron_patches.wallfacer import wallfacer_attention

    world, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    half = s // 2
    rows = torch.cat([torch.arange(c * half, (c + 1) * half) for c in rank_chunks("zigzag", world, me)])
    q, k, v, g = (torch.randn(world * s, b, h, d)[rows] for _ in range(4))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = {}
    for u, c, order in cands:
        p = world // u
        perm = ORDERS[order](p, c)

        def step(u=u, c=c, perm=perm):
            wallfacer_attention(*ins, dist.group.WORLD, c, ulysses_size=u, order=perm,
                                check=False).backward(g)
        step()  # groups and first-call buffers outside the timing
        out[name(u, c, order)] = {"step": step, "times": [], "cpu": []}
    interleaved(out, rounds)
    return out


def world_table(world: int, args, calib_cfg: dict) -> dict:
    from commweave.world import World
    from megatron_patches.calibrate import calibrate
    from megatron_patches.choice import candidates, plan_s
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    s, b, h, d = args.seq_per_rank, args.batch, args.heads, args.head_dim
    sh, nodes = Shard(s, b, h, h, d, 4, 4), [0] * world
    cands = candidates(world, sh, nodes)
    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with World(world, timeout=3600, start_timeout=900) as w:
        profiles = calibrate({**calib_cfg, "ranks": world}, world=w)
        per_rank = w.run(_measure, s, b, h, d, cands, args.reps + 1, timeout=3600)
    load1 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out = {"load": [load0, load1], "profiles": {k: p.to_json() for k, p in profiles.items()}}
    for clock, prof in profiles.items():
        topo = Topology.from_profile(prof, world)
        rows = []
        for u, c, order in cands:
            n = name(u, c, order)
            if clock == "wall":
                series = [max(r[n]["times"][i] for r in per_rank) for i in range(1, args.reps + 1)]
            else:
                series = [statistics.mean(r[n]["cpu"][i] for r in per_rank) for i in range(1, args.reps + 1)]
            rows.append({"name": n, "measured_ms": 1e3 * statistics.median(series),
                         "predicted_ms": 1e3 * plan_s(world, sh, nodes, topo, u, c, order)})
        out[clock] = summarize(rows)
        print_table(world, clock, out[clock], args, load0, load1)
    return out


def summarize(rows: list[dict]) -> dict:
    meas, pred = [r["measured_ms"] for r in rows], [r["predicted_ms"] for r in rows]
    for key, vals in (("measured_rank", meas), ("predicted_rank", pred)):
        for i, r in enumerate(sorted(range(len(rows)), key=lambda i: vals[i])):
            rows[r][key] = i + 1
    pick = min(range(len(rows)), key=lambda i: pred[i])
    best = min(meas)
    return {"rows": rows, "kendall_tau": kendall_tau(pred, meas), "pick": rows[pick]["name"],
            "best": rows[meas.index(best)]["name"], "pick_over_best": meas[pick] / best}


def print_table(world: int, clock: str, t: dict, args, load0: str, load1: str) -> None:
    print(f"\nP = {world}, {world * args.seq_per_rank} tokens, "
          f"{args.heads} heads x {args.head_dim}, fp32, causal; "
          f"{clock} clock, median of {args.reps} interleaved rounds; load {load0} -> {load1}")
    print(f"{'candidate':<22}{'measured ms':>12}{'predicted ms':>13}{'pred/meas':>10}{'rank meas':>10}"
          f"{'rank pred':>10}")
    for r in t["rows"]:
        print(f"{r['name']:<22}{r['measured_ms']:>12.1f}{r['predicted_ms']:>13.1f}"
              f"{r['predicted_ms'] / r['measured_ms']:>10.2f}"
              f"{r['measured_rank']:>10}{r['predicted_rank']:>10}")
    print(f"Kendall tau-b {t['kendall_tau']:.2f}; model's pick {t['pick']}, measured best {t['best']}; "
          f"the pick's measured time / the best's: {t['pick_over_best']:.3f}")


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
    line = {k: {clock: {m: v[clock][m] for m in ("kendall_tau", "pick", "best", "pick_over_best")}
                for clock in ("wall", "cpu")} for k, v in out.items()}
    print(json.dumps(line))
    return out


if __name__ == "__main__":
    main()
