"""One step of each candidate taken apart: where its CPU seconds go, beside the cost model's price of each.

    flock /tmp/commweave-bench.lock python -m benchmarks.cost_phases --world 4 --profile P.json [--calibrate]

Per candidate (U, C, order) of P gloo ranks (MHA, fp32, causal, --seq-per-rank rows per rank, as
benchmarks.cost_model runs them), the step's CPU seconds per rank split by where they are spent, counted
exclusively (a phase inside another is taken out of it), mean over ranks and rounds:

    kernels   steps.attend and backward.attend_backward: the block calls with their merges and
              accumulations (what the calibration's attention curves price)
    messages  comm.batch_p2p (posting sends and receives), comm.Handle.wait, the collectives
              (all-gather, reduce-scatter, all-to-all) — with gloo's own threads' CPU while in them
    rest      everything else: the team gathers' copies, D = rowsum(dO∘O), autograd, Python

beside the model's parts (placement.compute_steps summed; estimate less that; the head all-to-alls;
the profile's host work + memory traffic); then the messages by call (each counted function's exclusive
CPU seconds and its calls per step, both per rank). A profile is read (--profile) or first calibrated on
the same ranks (--calibrate, benchmarks.cost_model's calibration, written to --profile). The step is also
timed without the counting (the first column): the counting's own cost is the difference. The last column
prices the kernels again from the plans' exact calls (choice.call_shapes) timed alone in the same rounds as
the steps (same_round_profile): a kernel gap left there is in how a step runs its calls, not in drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

KERNELS = ("attend", "attend_bwd")
MESSAGES = ("batch_p2p", "wait", "all_gather", "reduce_scatter", "all_to_all")


class Phases:
    """Patches the named functions to count their CPU seconds (time.process_time: the whole process,
    gloo's threads included) inclusive and exclusive of the counted calls inside them; restores them on
    exit. ``targets``: (owner, attribute, phase name)."""

    def __init__(self, targets) -> None:
        self.targets, self.saved = list(targets), []
        self.incl: dict[str, float] = {}
        self.excl: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []

    def _wrap(self, fn, name: str):
        def counted(*args, **kwargs):
            self._stack.append(0.0)
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, inner = time.process_time() - t, self._stack.pop()
                self.incl[name] = self.incl.get(name, 0.0) + dt
                self.excl[name] = self.excl.get(name, 0.0) + dt - inner
                self.calls[name] = self.calls.get(name, 0) + 1
                if self._stack:
                    self._stack[-1] += dt
        return counted

    def __enter__(self) -> Phases:
        for owner, attr, name in self.targets:
            fn = getattr(owner, attr)
            self.saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(fn, name))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self.saved):
            setattr(owner, attr, fn)
        self.saved.clear()

    def reset(self) -> None:
        self.incl.clear()
        self.excl.clear()
        self.calls.clear()


def wallfacer_targets():
    """What a WallFacer step is split by (the module docstring), as Phases targets."""
    from commweave import comm
    from megatron_patches import backward, wallfacer

    return [(wallfacer, "attend", "attend"), (backward, "attend_backward", "attend_bwd"),
            *((comm, n, n) for n in ("batch_p2p", "all_gather", "reduce_scatter", "all_to_all")),
            (comm.Handle, "wait", "wait")]


def split(excl: dict[str, float], step: float) -> dict[str, float]:
    """A step's CPU seconds as kernels / messages / rest from the exclusive phase seconds."""
    kern = sum(excl.get(n, 0.0) for n in KERNELS)
    msgs = sum(excl.get(n, 0.0) for n in MESSAGES)
    return {"kernels": kern, "messages": msgs, "rest": step - kern - msgs}


def _measure(s: int, h: int, d: int, cands: list, rounds: int, calls: list) -> dict:
    """On every rank: per candidate and round, the step's CPU seconds without and with the counting, and
    the counted split (rounds interleaved and reversed as benchmarks.cost_model's; the first dropped);
    then, each round, every exact call of ``calls`` once, the calibration's way (calibrate.call_bench),
    under "_calls": the same calls timed alone at the same time as the steps, so the kernels' split can be
    priced without the minutes of drift between a calibration and the steps."""
    import torch
    import torch.distributed as dist

    from megatron_patches.calibrate import _timed, call_bench
    from megatron_patches.host import plan_key, plan_steps

    world = dist.get_world_size()
    steps = plan_steps(s, 1, h, d, cands)
    names = [plan_key(world, *c) for c in cands]
    out = {n: {"plain": [], "counted": [], "split": [], "calls": []} for n in names}
    benches = {tuple(c): call_bench(c, d, torch.float32, torch.device("cpu")) for c in calls}
    out["_calls"] = {c: [] for c in benches}
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order + order[::-1]:
            for counted in (False, True):
                phases = Phases(wallfacer_targets() if counted else [])
                with phases:
                    dist.barrier()
                    t = time.process_time()
                    steps[n]()
                    cpu = time.process_time() - t
                dist.barrier()
                if i:
                    out[n]["counted" if counted else "plain"].append(cpu)
                    if counted:
                        out[n]["split"].append(split(phases.excl, cpu))
                        out[n]["calls"].append({m: (phases.excl.get(m, 0.0), phases.calls.get(m, 0))
                                                for m in MESSAGES})
        for c, fn in benches.items():
            ((_, cpu),) = _timed(fn, 1, torch.device("cpu"), warm=False)
            if i:
                out["_calls"][c].append(cpu)
    return out


def same_round_profile(prof, per_rank: list, d: int):
    """``prof`` with its exact calls' seconds replaced by the same-round ones (_measure's "_calls": the
    mean over ranks, the median over rounds, as the CPU clock's calibration takes them)."""
    from dataclasses import replace

    from megatron_patches.profile import call_key

    def seconds(c) -> float:
        rounds = zip(*(r["_calls"][c] for r in per_rank), strict=True)
        return statistics.median(statistics.mean(ts) for ts in rounds)
    calls = {call_key(*c, d): seconds(c) for c in per_rank[0]["_calls"]}
    return replace(prof, calls={**prof.calls, **calls})


def model_parts(world: int, sh, topo, u: int, c: int, order: str) -> dict[str, float]:
    """The cost model's price of a plan in the same parts (choice.plan_s is their sum)."""
    from megatron_patches.choice import _all_to_all, _hybrid_parts, code_s
    from megatron_patches.layout import Layout
    from megatron_patches.placement import ORDERS, compute_steps, estimate

    inner, sub_nodes, shared = _hybrid_parts(sh, u, [0] * world, topo)
    p = world // u
    lay = Layout(p, c, ORDERS[order](p, c), "zigzag")
    kern = sum(sum(compute_steps(lay, inner, shared, True, back)) for back in (False, True))
    wire = estimate(lay, inner, sub_nodes, shared, True) - kern + _all_to_all(sh, u, [0] * world, topo)
    return {"kernels": kern, "messages": wire, "rest": code_s(world, sh, topo, u, c, order)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-per-rank", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--profile", required=True, help="a CPU-clock profile (written first with --calibrate)")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--json-out", default=None, help="also write the per-candidate figures (seconds) here")
    a = p.parse_args(argv)
    from commweave.world import World
    from megatron_patches.calibrate import calibrate, config, problem
    from megatron_patches.choice import candidates
    from megatron_patches.placement import Topology
    from megatron_patches.profile import load, save
    from megatron_patches.volume import Shard

    s, h, d, world = a.seq_per_rank, a.heads, a.head_dim, a.world
    sh = Shard(s, 1, h, h, d, 4, 4)
    cands = candidates(world, sh, [0] * world)
    prob = problem(world, s, h, d, "float32")  # as benchmarks.cost_model's: exact calls, ring's step
    calls = prob["calls"]
    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with World(world, timeout=3600, start_timeout=900) as w:
        if a.calibrate:
            heads = [h // u for u in range(1, min(h, world) + 1) if h % u == 0]
            cfg = config(["--out", a.profile, "--clock", "cpu", "--reps", "5", "--rows", "128", "256", "512",
                          "1024", "2048", "4096", "--sizes-log2", "12", "22", "--heads", *map(str, heads),
                          "--head-dim", str(d), "--max-rows-x-heads", str(int(world ** 0.5) * s * h)])
            save(calibrate({**cfg, "ranks": world, **prob}, world=w)["cpu"], a.profile)
        per_rank = w.run(_measure, s, h, d, cands, a.rounds + 1, calls, timeout=3600)
    topo = Topology.from_profile(load(a.profile), world)
    same = Topology.from_profile(same_round_profile(topo.profile, per_rank, d), world)
    load1 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"P = {world}, {s} rows per rank, {h} heads x {d}, fp32, causal; CPU ms per rank (mean over ranks, "
          f"median over {a.rounds} rounds); load {load0} -> {load1}, "
          f"{time.strftime('%H:%M UTC', time.gmtime())}")
    print(f"{'candidate':<16}{'step':>7}{'counted':>8}  kernels meas/model  messages meas/model"
          f"  rest meas/model  kernels at same-round calls")
    out = {}
    for cand in cands:
        key = f"{world} {cand[0]} {cand[1]} {cand[2]}"
        rows = [r[key] for r in per_rank]
        runs = range(2 * a.rounds)  # each round runs every candidate twice (A B … B A)
        meas = {part: statistics.median(statistics.mean(r["split"][i][part] for r in rows) for i in runs)
                for part in ("kernels", "messages", "rest")}
        plain, counted = (statistics.median(statistics.mean(r[k][i] for r in rows) for i in runs)
                          for k in ("plain", "counted"))
        model = model_parts(world, sh, topo, *cand)
        now = model_parts(world, sh, same, *cand)["kernels"]
        out[key] = {"plain": plain, "counted": counted, "measured": meas, "model": model,
                    "kernels_same_round": now}
        parts = "".join(f"{1e3 * meas[k]:>12.1f} /{1e3 * model[k]:>6.1f}" for k in meas)
        label = f"U={cand[0]} C={cand[1]} {cand[2]}"
        print(f"{label:<16}{1e3 * plain:>7.1f}{1e3 * counted:>8.1f}{parts}{1e3 * now:>16.1f}")
        out[key]["calls"] = {m: (statistics.median(statistics.mean(r["calls"][i][m][0] for r in rows)
                                                   for i in runs),
                                 statistics.mean(r["calls"][0][m][1] for r in rows)) for m in MESSAGES}
    print("messages by call (CPU ms per rank, exclusive; calls per step, mean over ranks):")
    for key, got in out.items():
        print(f"  {key:<18}" + "  ".join(f"{m} {1e3 * t:.1f} ({n:g})" for m, (t, n) in got["calls"].items()
                                         if n))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"load": [load0, load1], "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "candidates": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
