"""Measure this machine's cost profile (profile.py) with microbenchmarks, and write it for ``auto``:

    python -m megatron_patches.estimate --calibrate --ranks 8 --out profile.json
    python -m megatron_patches.calibrate --ranks 1 --device cuda --dtype bfloat16 --out gpu.json  # one GPU

Every microbenchmark runs on all ``--ranks`` ranks at once (gloo processes on this machine, as the
attention benchmark and a CPU job run them), because that is how the ranks of a step share the machine:
on a box with fewer cores than ranks a rank's kernel gets a share of a core, and its messages cost CPU
time too. Each figure is the median over ``--reps`` repetitions of the slowest rank.

- ``intra``: a ring exchange (every rank sends n bytes to the next while receiving from the previous,
  as a sub-ring hop does) at sizes 2^12..2^(12+k) bytes; α, β by least squares (cost.fit).
- ``collectives``: all-gather, reduce-scatter and all-to-all (commweave.comm, as wallfacer.py calls them)
  in groups of g consecutive ranks for every g > 1 dividing the ranks, all groups at once; α_g and
  β_g fitted against the bytes each rank moves, n·(g−1)/g; efficiency = β_intra / β_g. The all-gather's
  input is the rank's own slot of the output, as team.gather_team passes its wire (the q, k, v and the
  dO, D of C > 1 travel so): gloo's pairwise all-gather then skips the copy of the input onto the slot,
  which from a separate input cost 0.5 ms of a 1.8 ms all-gather of 3 MiB per rank in groups of 2 at
  P = 4 (CPU, paired, 40 reps; C = 2's team gathers of q, k, v). The lse gather, from its own tensor,
  moves 16 KiB per rank there.
- ``attention``: the per-block kernel wallfacer.py selects (block.select_kernel "auto"), on square
  blocks of n rows for n in --rows with each of --heads heads (the model's heads per rank and per
  Ulysses size: a call's fixed costs are spread over its heads too), full and causal, on strided
  [b, h, s, d] views of [s, b, h, d] tensors as wallfacer.py passes them, forward followed by the
  online-softmax merge into an accumulator (steps._merge, as attend does), backward followed by the
  three accumulations (as attend_backward does), all shapes interleaved (_timed_rounds); TFLOP/s
  counted as profile.FWD_FLOPS / BWD_FLOPS x score entries x b·h·d, against the work score entries x
  b·h (profile.py).
- ``calls`` (--calls-for S H): every block call the plans of the world make for that problem
  (choice.call_shapes: the rectangles and diagonal blocks at each plan's heads per call), each timed
  exactly as the curves' blocks, interleaved with them; the profile holds their seconds (Profile.calls).
- ``overlap``: one ring step's block forward and its hop alone, and the hop posted before the block and
  waited after it, the three interleaved (_timed_rounds, --overlap-reps repetitions: the three differ by
  less than the load drifts in a minute, so timed one after another the difference was drift). With
  --calls-for the step is ring attention's own for that problem (ring_step: the K/V hop of 2·s·b·h·d·elt
  bytes beside the block call most of its ranks make in a step), since the price applies to those calls;
  else a square block of --overlap-rows and --overlap-bytes. The value is the median over repetitions
  of t_block + t_hop − t_both (paired: the same repetition, the same load; a ratio of separate medians
  swung by the blocks' own noise, ±0.2 at 1 MiB) over min(t_block, t_hop), at most 1. In the wall clock
  also at least 0; in the CPU clock it may be below 0: CPU seconds do not hide behind each other, and a
  hop whose copies run on gloo's threads while the block runs costs more CPU than alone (contention for
  the cores and memory), which the step then pays per ring step (placement.Topology.step_s).
- ``gemm_tflops``: a [4096, H] x [H, H] matmul (H = --hidden), 2·4096·H² FLOPs.
- ``host``: every plan (U, C, order) of the world run through wallfacer_attention forward + backward on
  --host-rows rows per rank, plans interleaved; less the model's price of that tiny problem, the code
  path's own work per plan (host.py for the derivation; --host-rows 0: not measured).
- ``memory``: each plan's bytes per row moved outside its kernel blocks, traced at --host-rows and twice
  that, and the copy bandwidth (copy_ of 4 MiB, timed like the rest): memory.py (with --host-rows).

Across nodes nothing is measured here (one machine): the profile has no ``inter`` link, and the cost
model refuses to plan across nodes with it. With ``--ranks 1`` (one GPU) nothing but the kernels can be
measured: the links come from --intra-GBps / --intra-latency-us and the profile's provenance says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

from commweave import cost
from megatron_patches import host, memory
from megatron_patches.profile import (
    BWD_FLOPS,
    CURVES,
    FWD_FLOPS,
    KINDS,
    Collective,
    Curve,
    Kernel,
    Link,
    Profile,
    call_key,
    save,
)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, reps: int, device, inner: int = 1, warm: bool = True) -> list[tuple[float, float]]:
    """This rank's (wall, CPU) seconds per call of ``fn`` (``inner`` calls back to back), ``reps`` times,
    every rank starting together (a barrier before each repetition). CPU: the process's, all threads."""
    import torch.distributed as dist

    if warm:
        fn()  # warm-up: first-call allocations and kernel selection outside the timing
    out = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        t, c = time.perf_counter(), time.process_time()
        for _ in range(inner):
            fn()
        _sync(device)
        out.append(((time.perf_counter() - t) / inner, (time.process_time() - c) / inner))
    return out


def _timed_rounds(fns: dict, reps: int, device, inner: int = 1) -> dict:
    """_timed for several closures, interleaved: each repetition times every one once, starting one later
    each round (benchmarks.rounds' rule), so that the machine's load drifting over the minutes a
    calibration takes biases no kernel shape against another."""
    for fn in fns.values():
        fn()
    names, out = list(fns), {name: [] for name in fns}
    for i in range(reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            out[name] += _timed(fns[name], 1, device, inner, warm=False)
    return out


def _ring(n: int, device):
    import torch.distributed as dist

    from commweave import comm

    world, me = dist.get_world_size(), dist.get_rank()
    send, recv = torch.empty(n // 4, device=device), torch.empty(n // 4, device=device)

    def hop(wait: bool = True):
        works = comm.batch_p2p([comm.P2P("send", send, (me + 1) % world, dist.group.WORLD),
                                comm.P2P("recv", recv, (me - 1) % world, dist.group.WORLD)])
        if wait:
            comm.wait_all(works)
        return works
    return hop


def _attention(rows: int, heads: int, d: int, dtype, device, causal: bool, backward: bool,
               keys: int | None = None):
    """One block call as wallfacer.py makes it: q, dO as [b, h, rows, d] and k, v as [b, h, keys, d]
    (keys = rows by default; a causal call is a diagonal block, keys = rows) views of [rows, b, h, d]
    tensors (steps.bhsd: the kernels take them strided), the forward merged into an all-gather-order
    accumulator (steps.attend), the backward's dq, dk, dv added into theirs (steps.attend_backward)."""
    from megatron_patches.block import select_kernel
    from megatron_patches.steps import _merge, bhsd

    keys = rows if keys is None else keys
    kernel = select_kernel("auto", device, dtype, head_dim=d)
    q, do, k, v = (bhsd(torch.randn(n, 1, heads, d, dtype=dtype, device=device))
                   for n in (rows, rows, keys, keys))
    o, lse = kernel.forward(q, k, v, d ** -0.5, causal)
    acc_o = torch.zeros(1, rows, 1, heads, d, dtype=torch.float32, device=device)
    bhsd(acc_o[0]).copy_(o)
    acc_lse = lse.float().clone()
    grads = [torch.zeros(n, 1, heads, d, dtype=torch.float32, device=device) for n in (rows, keys, keys)]

    def fwd():
        o_b, lse_b = kernel.forward(q, k, v, d ** -0.5, causal)
        _merge(bhsd(acc_o[0]), acc_lse, o_b, lse_b)

    def bwd():
        for acc, g in zip(grads, kernel.backward(do, q, k, v, o, lse, d ** -0.5, causal), strict=True):
            bhsd(acc).add_(g)
    return bwd if backward else fwd


def call_bench(call, d: int, dtype, device):
    """The microbenchmark of one exact block call (curve, rows, keys, heads): _attention of that shape."""
    name, rows, keys, heads = call
    return _attention(rows, heads, d, dtype, device, name.endswith("causal"), name.startswith("bwd"), keys)


def kernel_rows(cfg: dict, heads: int) -> list[int]:
    """The block sizes measured at ``heads`` heads: --rows, up to --max-rows-x-heads / heads (a model's calls
    have fewer heads where they have more rows: U·s rows of h/U heads), at least the smallest."""
    cap = cfg.get("max_rows_x_heads")
    rows = [n for n in cfg["rows"] if cap is None or n * heads <= cap]
    return rows or cfg["rows"][:1]


def _collective(kind: str, group, n: int, device):
    from commweave import comm

    g = comm.size(group)
    if kind == "all_gather":  # n = the gathered buffer, in place as team.gather_team gathers (docstring)
        out = torch.empty(g, n // 4 // g, device=device)
        return lambda: comm.all_gather(out, out[comm.rank(group)], group)
    inp = torch.ones(n // 4 // g * g, device=device)
    out = torch.empty(n // 4 // g, device=device) if kind == "reduce_scatter" else torch.empty_like(inp)
    fn = comm.reduce_scatter if kind == "reduce_scatter" else comm.all_to_all
    return lambda: fn(out, inp, group)


def measure(cfg: dict) -> dict:
    """On every rank: this rank's times of every microbenchmark (the parent takes the slowest)."""
    import torch.distributed as dist

    from commweave import comm

    device, dtype, reps = torch.device(cfg["device"]), getattr(torch, cfg["dtype"]), cfg["reps"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    kernels = {(name, rows, h): _attention(rows, h, cfg["head_dim"], dtype, device, name.endswith("causal"),
                                           name.startswith("bwd"))
               for name in CURVES for h in cfg["heads"] for rows in kernel_rows(cfg, h)}
    kernels.update({tuple(call): call_bench(call, cfg["head_dim"], dtype, device) for call in cfg["calls"]})
    out: dict = {"attention": _timed_rounds(kernels, reps, device)}
    del kernels
    a = torch.randn(4096, cfg["hidden"], dtype=dtype, device=device)
    w = torch.randn(cfg["hidden"], cfg["hidden"], dtype=dtype, device=device)
    out["gemm"] = _timed(lambda: a @ w, reps, device)
    if world == 1:
        return out
    out["ring"] = {n: _timed(_ring(n, device), reps, device, cfg["inner"]) for n in cfg["sizes"]}
    out["coll"] = {}
    me = dist.get_rank()
    for g in (g for g in range(2, world + 1) if world % g == 0):
        groups = [comm.new_group(list(range(i, i + g)), f"calib{g}.{i}") for i in range(0, world, g)]
        mine = groups[me // g]
        for kind in KINDS:
            for n in cfg["sizes"]:
                fn = _collective(kind, mine, n * g, device)
                out["coll"][kind, g, n * g] = _timed(fn, reps, device, cfg["inner"])
    if cfg.get("overlap_calls"):  # ring attention's own step (ring_step)
        benches = [call_bench(c, cfg["head_dim"], dtype, device) for c in cfg["overlap_calls"]]

        def block():
            for fn in benches:
                fn()
    else:
        block = _attention(cfg["overlap_rows"], max(cfg["heads"]), cfg["head_dim"], dtype, device, False,
                           False)
    hop = _ring(cfg["overlap_bytes"], device)

    def both():
        works = hop(wait=False)
        block()
        comm.wait_all(works)
    out["overlap"] = _timed_rounds({"block": block, "hop": hop, "both": both}, cfg["overlap_reps"], device)
    if cfg["host_rows"]:
        plans = host.host_plans(world, max(cfg["heads"]), cfg["head_dim"], dtype.itemsize, 4)
        steps = host.plan_steps(cfg["host_rows"], 1, max(cfg["heads"]), cfg["head_dim"], plans, dtype, device)
        out["host"] = _timed_rounds(steps, reps, device, cfg["inner"])
        twice = host.plan_steps(2 * cfg["host_rows"], 1, max(cfg["heads"]), cfg["head_dim"], plans, dtype,
                                device)
        out["memory"] = {k: memory.row_bytes(steps[k], twice[k], cfg["host_rows"]) for k in steps}
        out["copy"] = _timed(memory.copy_step(device, dtype), reps, device, cfg["inner"])
    return out


def profile_from(per_rank: list, cfg: dict, description: str, clock: str = "wall") -> Profile:
    """The Profile of the ranks' measurements (see the module docstring for each derivation), in ``clock``
    seconds: "wall" (median over repetitions of the slowest rank) or "cpu" (of the mean over ranks of
    each rank's process CPU time: the work, which other users of a shared machine change less)."""
    r0 = per_rank[0]

    def _series(ranks: list, get) -> list[float]:
        """Per repetition: the slowest rank's wall seconds, or the ranks' mean CPU seconds."""
        if clock == "wall":
            return [max(t[0] for t in ts) for ts in zip(*(get(r) for r in ranks), strict=True)]
        return [statistics.mean(t[1] for t in ts) for ts in zip(*(get(r) for r in ranks), strict=True)]

    def _slowest(ranks: list, get) -> float:
        return statistics.median(_series(ranks, get))
    curves = {}
    for name in CURVES:
        per_flop = BWD_FLOPS if name.startswith("bwd") else FWD_FLOPS
        table = {}
        for h in cfg["heads"]:
            pts = []
            for rows in kernel_rows(cfg, h):
                scores = rows * (rows + 1) / 2 if name.endswith("causal") else rows * rows
                t = _slowest(per_rank, lambda r, k=(name, rows, h): r["attention"][k])
                pts.append((float(scores * h), per_flop * scores * h * cfg["head_dim"] / t / 1e12))
            table[h] = Curve(tuple(pts))
        curves[name] = Kernel(table)
    calls = {call_key(*call, cfg["head_dim"]): _slowest(per_rank, lambda r, k=tuple(call): r["attention"][k])
             for call in cfg["calls"]}
    gemm = 2 * 4096 * cfg["hidden"] ** 2 / _slowest(per_rank, lambda r: r["gemm"]) / 1e12
    provenance = {"ranks": len(per_rank), "device": cfg["device"], "dtype": cfg["dtype"], "clock": clock,
                  "load_before": cfg.get("load_before"), "load_after": os.getloadavg()[0],
                  "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "command": cfg.get("command")}
    if "ring" not in r0:  # one rank: nothing to send to
        provenance["links"] = (f"spec ({cfg['intra_gbytes']} GB/s, {cfg['intra_us']} us): one rank has no "
                               f"peer to measure")
        return Profile("measured", description, 1, Link(cfg["intra_us"] * 1e-6, cfg["intra_gbytes"]), {},
                       curves, 1.0, gemm, provenance=provenance, calls=calls)
    sizes = cfg["sizes"]
    ring_s = [_slowest(per_rank, lambda r, n=n: r["ring"][n]) for n in sizes]
    ring = cost.fit(sizes, ring_s)
    intra = Link(ring.model.alpha, 1 / max(ring.model.beta, 1e-15) / 1e9)
    colls: dict = {}
    # The fitted points, kept in the provenance ("bytes": seconds) so a fit can be checked afterwards.
    points = {"ring": {str(n): t for n, t in zip(sizes, ring_s, strict=True)}}
    for kind in KINDS:
        for g in sorted({g for k, g, _ in r0["coll"] if k == kind}):
            ns = sorted(n for k, gg, n in r0["coll"] if (k, gg) == (kind, g))
            ts = [_slowest(per_rank, lambda r, key=(kind, g, n): r["coll"][key]) for n in ns]
            fit = cost.fit([n * (g - 1) / g for n in ns], ts)
            eff = min(intra.beta / max(fit.model.beta, 1e-15), 4.0)
            colls.setdefault(kind, {})[g] = Collective(fit.model.alpha, eff)
            points[f"{kind} {g}"] = {str(n): t for n, t in zip(ns, ts, strict=True)}
    ser = {k: _series(per_rank, lambda r, k=k: r["overlap"][k]) for k in ("block", "hop", "both")}
    ov = {k: statistics.median(v) for k, v in ser.items()}
    hidden = statistics.median(b + h - x for b, h, x in zip(*(ser[k] for k in ("block", "hop", "both")),
                                                            strict=True))
    overlap = hidden / min(ov["block"], ov["hop"])
    provenance.update(ring_r2=round(ring.r2, 4), overlap_s={**{k: round(v, 6) for k, v in ov.items()},
                                                           "hidden": round(hidden, 6)},
                      message_s=points)
    overlap = min(overlap, 1.0) if clock == "cpu" else min(max(overlap, 0.0), 1.0)  # see the docstring
    prof = Profile("measured", description, len(per_rank), intra, colls, curves, overlap,
                   gemm, provenance=provenance, calls=calls)
    if "host" not in r0:
        return prof
    tiny = {k: _slowest(per_rank, lambda r, k=k: r["host"][k]) for k in r0["host"]}
    provenance.update(host_rows=cfg["host_rows"], host_tiny_s={k: round(v, 6) for k, v in tiny.items()})
    elt = getattr(torch, cfg["dtype"]).itemsize
    table = host.host_table(tiny, len(per_rank), max(cfg["heads"]), cfg["head_dim"], elt, 4, prof)
    if "memory" not in r0:
        return replace(prof, host=table)
    pick = max if clock == "wall" else statistics.mean  # the slowest rank, or the ranks' mean work
    mem = {"gbytes": 2 * memory.COPY_BYTES / _slowest(per_rank, lambda r: r["copy"]) / 1e9,
           "rows": cfg["host_rows"], "trace_bytes": max(cfg["heads"]) * cfg["head_dim"] * elt,
           "row_bytes": {k: pick(r["memory"][k] for r in per_rank) for k in r0["memory"]}}
    return replace(prof, host=table, memory=mem)


def measurements(cfg: dict, world=None) -> list:
    """Every rank's measurements, on ``world`` (a commweave World of cfg["ranks"]) or new ranks."""
    if cfg["ranks"] == 1:
        return [measure(cfg)]
    if world is not None:
        return world.run(measure, cfg, timeout=3600)
    from commweave.world import World

    with World(cfg["ranks"], timeout=3600, start_timeout=900) as w:
        return w.run(measure, cfg)


def calibrate(cfg: dict, description: str = "", world=None) -> dict[str, Profile]:
    """The profile of cfg's microbenchmarks in both clocks: {"wall": ..., "cpu": ...}."""
    cfg = {**cfg, "load_before": os.getloadavg()[0]}
    description = description or f"{cfg['ranks']} {cfg['device']} rank(s) of this machine, {cfg['dtype']}"
    per_rank = measurements(cfg, world)
    return {clock: profile_from(per_rank, cfg, f"{description}, {clock} clock", clock)
            for clock in ("wall", "cpu")}


def config(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m megatron_patches.estimate --calibrate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--ranks", type=int, default=8, help="ranks measured at once (one per GPU of a node)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what the profile's seconds are: wall time, or process CPU time (shared machines)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--inner", type=int, default=4, help="messages back to back per repetition")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--sizes-log2", type=int, nargs=2, default=[12, 22], metavar=("LO", "HI"),
                   help="message sizes 2^LO..2^HI bytes per rank")
    p.add_argument("--heads", type=int, nargs="+", default=[8],
                   help="heads per call: the model's per rank (h/U for each Ulysses size U auto may take)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--max-rows-x-heads", type=int, default=None,
                   help="measure a block of n rows at h heads only where n x h <= this (default: all)")
    p.add_argument("--calls-for", type=int, nargs=2, default=None, metavar=("S", "H"),
                   help="also measure exactly every block call the plans of --ranks ranks make for S rows "
                        "per rank of H heads (batch 1, MHA, --head-dim; choice.call_shapes)")
    p.add_argument("--overlap-rows", type=int, default=512,
                   help="the overlap's square block, without --calls-for (with it: ring attention's step)")
    p.add_argument("--overlap-bytes", type=int, default=None,
                   help="the overlap's hop (default: ring attention's K/V hop with --calls-for, else 1 MiB)")
    p.add_argument("--overlap-reps", type=int, default=90,
                   help="repetitions of the overlap microbenchmark (block + hop + both: ~15 ms each on CPU)")
    p.add_argument("--host-rows", type=int, default=host.HOST_ROWS, choices=(0, host.HOST_ROWS),
                   help="rows per rank of the host-work runs (host.py); 0: host work not measured")
    p.add_argument("--intra-GBps", type=float, default=450.0, help="--ranks 1 only: the link, from specs")
    p.add_argument("--intra-latency-us", type=float, default=3.0, help="--ranks 1 only")
    a = p.parse_args(argv)
    for flag, value, low in (("--ranks", a.ranks, 1), ("--reps", a.reps, 1), ("--inner", a.inner, 1),
                             ("--heads", min(a.heads), 1), ("--head-dim", a.head_dim, 1),
                             ("--hidden", a.hidden, 1), ("--overlap-rows", a.overlap_rows, 1),
                             ("--overlap-bytes", 4096 if a.overlap_bytes is None else a.overlap_bytes, 4096),
                             ("--overlap-reps", a.overlap_reps, 1)):
        if value < low:
            p.error(f"{flag} {value} must be >= {low}")
    lo, hi = a.sizes_log2
    if not 10 <= lo < hi <= 30:
        p.error(f"--sizes-log2 {lo} {hi} must satisfy 10 <= LO < HI <= 30")
    if not a.rows or min(a.rows) < 16 or len(set(a.rows)) != len(a.rows):
        p.error(f"--rows {a.rows} must be distinct sizes >= 16")
    if a.calls_for is not None and min(a.calls_for) < 1:
        p.error(f"--calls-for {a.calls_for[0]} {a.calls_for[1]} must be two integers >= 1")
    if not (a.intra_GBps > 0 and a.intra_latency_us >= 0):
        p.error(f"--intra-GBps {a.intra_GBps} must be > 0 and --intra-latency-us {a.intra_latency_us} >= 0")
    prob = {"calls": [], "overlap_calls": [], "overlap_bytes": 1 << 20} if a.calls_for is None else \
        problem(a.ranks, *a.calls_for, a.head_dim, a.dtype)
    return {"out": a.out, "clock": a.clock, "ranks": a.ranks, "device": a.device, "dtype": a.dtype,
            "reps": a.reps, "inner": a.inner, "rows": sorted(a.rows),
            "sizes": [1 << i for i in range(lo, hi + 1)],
            "heads": sorted(set(a.heads)), "head_dim": a.head_dim, "hidden": a.hidden,
            "overlap_rows": a.overlap_rows, "max_rows_x_heads": a.max_rows_x_heads,
            **prob, "overlap_reps": a.overlap_reps, "host_rows": a.host_rows,
            "intra_gbytes": a.intra_GBps, "intra_us": a.intra_latency_us,
            **({} if a.overlap_bytes is None else {"overlap_bytes": a.overlap_bytes})}


def problem(ranks: int, s: int, h: int, d: int, dtype: str, b: int = 1) -> dict:
    """The calibration's fields for one problem (s rows per rank of b x h heads of d on ``ranks`` ranks):
    every plan's exact block calls, and the overlap at ring attention's own step (one rank: none, the
    square block and 1 MiB)."""
    step = ([], 1 << 20) if ranks == 1 else ring_step(ranks, s, h, d, dtype)
    return {"calls": plan_calls(ranks, s, h, d, dtype, b), "overlap_calls": step[0], "overlap_bytes": step[1]}


def ring_step(ranks: int, s: int, h: int, d: int, dtype: str) -> tuple[list[list], int]:
    """Ring attention's step for s rows per rank of h heads of d on ``ranks`` ranks (C = 1, zigzag, causal,
    batch 1): the block calls most of its ranks make in its second step (placement.step_shapes; from then
    on every step is rectangles of that work) and the bytes of its forward K/V hop, 2·s·h·d·elt (the K/V
    stack each rank sends per step, volume.py)."""
    from megatron_patches.layout import Layout
    from megatron_patches.placement import step_shapes, team_major

    shapes = step_shapes(Layout(ranks, 1, team_major(ranks, 1), "zigzag"), s, True)
    calls, _ = max(shapes[min(1, len(shapes) - 1)], key=lambda kind: kind[1])
    return ([["fwd_causal" if diag else "fwd", rows, keys, h] for rows, keys, diag in calls],
            2 * s * h * d * getattr(torch, dtype).itemsize)


def plan_calls(ranks: int, s: int, h: int, d: int, dtype: str, b: int = 1) -> list[list]:
    """choice.call_shapes of every plan of ``ranks`` ranks on one node, s rows per rank, b x h heads of d."""
    from megatron_patches.choice import call_shapes
    from megatron_patches.volume import Shard

    return [list(c) for c in call_shapes(ranks, Shard(s, b, h, h, d, getattr(torch, dtype).itemsize, 4),
                                         [0] * ranks)]


def main(argv=None) -> Profile:
    cfg = config(argv)
    given = sys.argv[1:] if argv is None else argv
    cfg["command"] = "python -m megatron_patches.calibrate " + " ".join(given)
    prof = calibrate(cfg)[cfg["clock"]]
    save(prof, cfg["out"])
    print(json.dumps(prof.to_json()))
    return prof


if __name__ == "__main__":
    main()
