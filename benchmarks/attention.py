"""Causal attention, forward + backward, under sequence parallelism on CPU ranks, side by side:

    python -m benchmarks.attention                      # P = 4 and 8, then the P2P bytes at P = 16
    python -m benchmarks.attention --worlds 8 --reps 9  # one world, more repetitions

Rows per world of P gloo ranks (one thread each), N = P × --seq-per-rank tokens, MHA, fp32:

    wallfacer C=c    megatron_patches.wallfacer_attention, every valid team size c > 1 (zigzag rows),
                     team Q/K/V rebuilt in the backward (team_qkv="auto")
    ... keep         the largest c with the team Q/K/V kept from the forward instead
    ring (C=1)       the same code with C = 1: zigzag ring attention, as ring-flash-attention runs it
    U=u C=c          Ulysses x WallFacer (ulysses_size=u): head all-to-all inside groups of u ranks,
                     WallFacer with team size c over the P/u groups; every valid (u, c) with u > 1
                     (u = P is Ulysses alone, in the same code; "contig" runs it on contiguous
                     rows, as DeepSpeed-Ulysses, where its all-to-all needs no reordering)
    ulysses          deepspeed.sequence.layer.DistributedAttention (DeepSpeed-Ulysses: all-to-all to
                     head shards, local causal SDPA, all-to-all back; contiguous rows)
    compute only     the hardware limit: ring attention's code with every message dropped, so each
                     rank makes the same kernel calls on its own K/V and communicates nothing (its
                     output is not attention, so it has no error column)

Each row: median over rounds (rows interleaved within a round, each round starting one row later) of
the slowest rank's time, and of the CPU time a rank's process spends (all its threads, mean over
ranks: the work, which other users of a shared machine do not change as much as they change the
wall time); the error
against full attention on the same rows; bytes each rank sends per forward / backward from the ledger
(DeepSpeed's all-to-alls through commweave.comm.trace_torch_distributed), mean over ranks; peak live
tensor memory per rank during one step (see below), max over ranks. Then the memory table, the
forward P2P bytes of every C at P = 16 (the C = 4 case), the alpha-beta *projections*
(placement.estimate, not measurements) for the paper's clusters, and one JSON line of ratios.

Memory (paper §3.2.2). Method: the torch profiler with ``profile_memory`` sees every allocation and
free of the CPU allocator (c10's ProfiledCPUMemoryReporter), each with the running total of bytes
allocated while profiling; the peak is the largest total above the one before the first allocation,
so it counts every tensor the step allocates and holds at once (activations, what autograd saves,
gradients, receive buffers, gloo staging tensors of the pairwise collectives) and not the inputs
made before. WallFacer keeps some CPU buffers between calls (steps.Run.empty: CPU torch has no
caching allocator); they are freed before each measurement (steps.release_buffers), so their
first allocation falls inside it and counts; the table also prints what stays kept afterwards.
The model: Y layers, each q = x + β_q, k = x + β_k, v = x + β_v (parameters [h, d]; an add saves
nothing), x ← attention(q, k, v); loss = Σ x·g; forward and backward. Nothing is recomputed, so
every layer holds what its attention saves: ring attention its q, the K/V stack and O (4A, A = one
rank's s·b·h·d activation), WallFacer "keep" the team's Q and placed K/V and O ((3C + 1)·A), "rebuild"
its q, k, v and O (4A) and the team's 3C·A only while one layer's backward runs. The paper's model
(eqs. 5, 6: ring M + (Y + 4)·A, WallFacer M + (Y + 3C + 1)·A) checkpoints each layer at one A, so
it is printed beside the measurement; what compares is the extra over ring attention, 3(C − 1)·A,
which "rebuild" pays once and "keep" once per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.rounds import interleaved
from commweave import comm, ledger
from commweave.world import World
from megatron_patches.block import select_kernel
from megatron_patches.groups import WallFacerGroups
from megatron_patches.hybrid import ulysses_error
from megatron_patches.layout import Layout, rank_chunks, valid_team_sizes
from megatron_patches.placement import ORDERS, estimate
from megatron_patches.steps import keep_cpu_buffers, kept_buffer_bytes, release_buffers
from megatron_patches.volume import Shard
from megatron_patches.wallfacer import wallfacer_attention

KINDS = ("send", "all_gather", "reduce_scatter", "all_to_all")


def _rows(layout: str, world: int, rank: int, s: int) -> torch.Tensor:
    half = s // 2
    return torch.cat([torch.arange(c * half, (c + 1) * half) for c in rank_chunks(layout, world, rank)])


def _bhsd(*ts):
    return [t.permute(1, 2, 0, 3) for t in ts]


def _local_sdpa(q, k, v):
    """Ulysses' local attention: [N, b, h/P, d] → causal SDPA (the flash kernel on CPU)."""
    return F.scaled_dot_product_attention(*_bhsd(q, k, v), is_causal=True).permute(2, 0, 1, 3)


class _Silent(WallFacerGroups):
    """Ring attention's groups with every message dropped: the same kernel calls, nothing sent."""

    def ring_shift(self, sends, recvs, tag):
        return []

    def permute(self, send, dst, recv, src, tag):
        return []


def _compute_only(world: int, me: int, head_dim: int):
    # wallfacer's private autograd Function, driven with the silent groups (benchmark-only use).
    from megatron_patches.steps import Run
    from megatron_patches.wallfacer import _WallFacer

    groups = _Silent(dist.group.WORLD, Layout(world, 1), me, None, None, {})
    kernel = select_kernel("auto", torch.device("cpu"), torch.float32)
    run = Run(groups, kernel, head_dim ** -0.5, True, "kv")
    return lambda q, k, v: _WallFacer.apply(q, k, v, run)


def hybrids(world: int, heads: int) -> list[tuple[int, int]]:
    """Every valid (U, C) of Ulysses x WallFacer with U > 1 for ``heads`` MHA heads."""
    return [(u, c) for u in range(2, world + 1) if not ulysses_error(world, u, heads, heads)
            for c in reversed(valid_team_sizes(world // u))]


def _methods(world: int, me: int, head_dim: int, heads: int):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")
    group = dist.group.WORLD
    ulysses = DistributedAttention(_local_sdpa, group, scatter_idx=2, gather_idx=0)
    methods = {f"wallfacer C={c}" if c > 1 else "ring (C=1)":
               ("zigzag", lambda q, k, v, c=c: wallfacer_attention(q, k, v, group, c, check=False))
               for c in reversed(valid_team_sizes(world))}
    c = max(valid_team_sizes(world))
    if c > 1:
        methods[f"wallfacer C={c} keep"] = ("zigzag", lambda q, k, v, c=c: wallfacer_attention(
            q, k, v, group, c, team_qkv="keep", check=False))
    for u, c in hybrids(world, heads):
        methods[f"U={u} C={c}"] = ("zigzag", lambda q, k, v, u=u, c=c: wallfacer_attention(
            q, k, v, group, c, ulysses_size=u, check=False))
    if not ulysses_error(world, world, heads, heads):  # Ulysses alone, on the rows DeepSpeed's gets
        methods[f"U={world} C=1 contig"] = ("contiguous", lambda q, k, v: wallfacer_attention(
            q, k, v, group, 1, layout="contiguous", ulysses_size=world, check=False))
    methods["ulysses"] = ("contiguous", lambda q, k, v: ulysses(q, k, v, 1))
    methods["compute only"] = ("zigzag", _compute_only(world, me, head_dim))
    return methods


def _peak_bytes(step, keep: bool = True) -> int:
    """Peak growth of the CPU allocator's live bytes during ``step``: each allocation event the profiler
    records carries the allocator's running total. WallFacer's kept buffers are released first, so
    that their allocation counts; ``keep=False`` frees them after each use instead (as on CUDA)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    keep_cpu_buffers(keep)
    release_buffers()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    keep_cpu_buffers(True)
    allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            allocs.append((e.start_time_ns, e.typed[1].total_allocated, e.typed[1].alloc_size))
    allocs.sort()
    return max(total for _, total, _ in allocs) - (allocs[0][1] - allocs[0][2])


def _measure(s: int, b: int, h: int, d: int, rounds: int):
    """On every rank: errors, ledger bytes, peak memory, then ``rounds`` interleaved timed steps."""
    world, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    n = world * s
    q, k, v, g = (torch.randn(n, b, h, d) for _ in range(4))
    methods = _methods(world, me, d, h)
    out = {}
    for name, (layout, fn) in methods.items():
        rows = _rows(layout, world, me, s)
        ins = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        causal = rows[:, None] >= torch.arange(n)
        ref = F.scaled_dot_product_attention(*_bhsd(q[rows], k, v), attn_mask=causal)
        with ledger.recording() as fwd, comm.trace_torch_distributed():
            o = fn(*ins)
        with ledger.recording() as bwd, comm.trace_torch_distributed():
            o.backward(g[rows])
        err = (o.detach() - ref.permute(2, 0, 1, 3)).abs().max().item() if name != "compute only" else None

        def step(fn=fn, ins=ins, grad=g[rows]):
            fn(*ins).backward(grad)

        out[name] = {"err": err, "fwd": {kind: fwd.sent(kind) for kind in KINDS},
                     "bwd": {kind: bwd.sent(kind) for kind in KINDS}, "peak": _peak_bytes(step),
                     "step": step, "times": [], "cpu": []}
    interleaved(out, rounds)
    return out


def _memory(s: int, b: int, h: int, d: int, layers: list[int]):
    """Peak bytes of one forward + backward of the Y-layer model (module docstring) per method and Y,
    with WallFacer's CPU buffers kept between calls (the CPU default) and not kept (as on CUDA); and
    the bytes kept afterwards."""
    world, group = dist.get_world_size(), dist.group.WORLD
    c = max(valid_team_sizes(world))
    methods = {"ring (C=1)": (1, "keep"), f"wallfacer C={c} keep": (c, "keep"),
               f"wallfacer C={c} rebuild": (c, "rebuild")}
    torch.manual_seed(dist.get_rank())
    out = {}
    for name, (team, team_qkv) in methods.items():
        for y in layers:
            x0 = torch.randn(s, b, h, d, requires_grad=True)
            betas = [torch.zeros(3, h, d, requires_grad=True) for _ in range(y)]
            grad = torch.randn(s, b, h, d)

            def step(x0=x0, betas=betas, grad=grad, team=team, team_qkv=team_qkv):
                for t in (x0, *betas):
                    t.grad = None
                x = x0
                for beta in betas:
                    x = wallfacer_attention(x + beta[0], x + beta[1], x + beta[2], group, team,
                                            team_qkv=team_qkv, check=False)
                (x * grad).sum().backward()

            step()  # groups and first-call work outside the measurement
            live = _peak_bytes(step, keep=False)
            out[name, y] = (_peak_bytes(step), kept_buffer_bytes(), live)
    return out


def memory_world(world: int, args, layers=(1, 4)) -> dict:
    s, b, h, d = args.seq_per_rank, args.batch, args.heads, args.head_dim
    with World(world, timeout=1800, start_timeout=900) as w:
        per_rank = w.run(_memory, s, b, h, d, list(layers))
    a = s * b * h * d * 4
    c = max(valid_team_sizes(world))
    print(f"\nPeak memory per rank at P = {world} (max over ranks), {s} rows x {b} x {h} heads x {d}, fp32, "
          f"A = {a / 2**20:.2f} MiB; Y layers forward + backward, nothing recomputed")
    print(f"{'':<27}{'buffers kept (CPU)':>27}{'buffers freed (as CUDA)':>25}{'paper eqs. (5), (6)':>23}")
    print(f"{'method':<24}{'Y':>3}{'MiB':>7}{'/A':>6}{'extra/A':>8}{'kept MiB':>9}{'MiB':>7}{'/A':>6}"
          f"{'extra/A':>8}{'A':>4}{'MiB':>7}{'extra/A':>9}")
    rows = {}
    for (name, y) in per_rank[0]:
        peak, kept, live = (max(r[name, y][i] for r in per_rank) for i in range(3))
        rows[name, y] = {"peak_a": peak / a, "kept_mib": kept / 2**20, "freed_peak_a": live / a}
    for (name, y), r in rows.items():
        ring = rows["ring (C=1)", y]
        team = 1 if name.startswith("ring") else c
        paper = y + 3 * team + 1 if team > 1 else y + 4
        r.update(extra_a=r["peak_a"] - ring["peak_a"], freed_extra_a=r["freed_peak_a"] - ring["freed_peak_a"],
                 paper_a=paper, paper_extra_a=3 * (team - 1))
        print(f"{name:<24}{y:>3}{r['peak_a'] * a / 2**20:>7.1f}{r['peak_a']:>6.1f}{r['extra_a']:>8.1f}"
              f"{r['kept_mib']:>9.1f}{r['freed_peak_a'] * a / 2**20:>7.1f}{r['freed_peak_a']:>6.1f}"
              f"{r['freed_extra_a']:>8.1f}{paper:>4}{paper * a / 2**20:>7.1f}{3 * (team - 1):>9}")
    print("(peak: bytes allocated and live at once during the step; extra: over ring attention at the same "
          "Y; kept: WallFacer's CPU buffers held between calls after the step; paper: activations only, "
          "model and optimizer M left out, one checkpoint per layer)")
    return {f"{name} Y={y}": {k: round(v, 2) for k, v in r.items()} for (name, y), r in rows.items()}


def _p2p_bytes(s: int, b: int, h: int, d: int):
    """Forward and backward P2P bytes this rank sends, for every C (small shapes, no timing)."""
    world, out = dist.get_world_size(), {}
    x = [torch.randn(s, b, h, d, requires_grad=True) for _ in range(3)]
    for c in valid_team_sizes(world):
        with ledger.recording() as fwd:
            o = wallfacer_attention(*x, dist.group.WORLD, c, check=False)
        with ledger.recording() as bwd:
            o.backward(torch.ones_like(o))
        out[c] = (fwd.sent("send"), bwd.sent("send"))
    return out


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_world(world: int, args) -> dict:
    with World(world, timeout=1800, start_timeout=900) as w:
        per_rank = w.run(_measure, args.seq_per_rank, args.batch, args.heads, args.head_dim, args.reps + 1)
    rows = {}
    for name in per_rank[0]:
        slowest = [max(r[name]["times"][i] for r in per_rank) for i in range(1, args.reps + 1)]
        errs = [r[name]["err"] for r in per_rank if r[name]["err"] is not None]
        cpu = [statistics.mean(r[name]["cpu"][i] for r in per_rank) for i in range(1, args.reps + 1)]
        rows[name] = {"ms": 1e3 * statistics.median(slowest), "err": max(errs) if errs else None,
                      "cpu_ms": 1e3 * statistics.median(cpu),
                      "peak_mb": max(r[name]["peak"] for r in per_rank) / 1e6,
                      **{f"{phase}_{kind}": statistics.mean(r[name][phase][kind] for r in per_rank) / 1e6
                         for phase in ("fwd", "bwd") for kind in KINDS}}
    ring = rows["ring (C=1)"]
    print(f"\nP = {world} ranks, N = {world * args.seq_per_rank} tokens, b = {args.batch}, "
          f"{args.heads} heads x {args.head_dim}, fp32, causal; median of {args.reps} rounds; load {_load()}")
    print(f"{'method':<20}{'ms fwd+bwd':>11}{'ring/x':>7}{'cpu ms':>7}{'max err':>9}{'P2P fwd MB':>11}"
          f"{'P2P bwd MB':>11}{'AG MB':>7}{'RS MB':>7}{'A2A MB':>7}{'peak MB':>8}{'P2P fwd/ring':>13}")
    for name, r in rows.items():
        coll = {kind: r[f"fwd_{kind}"] + r[f"bwd_{kind}"] for kind in KINDS}
        err = f"{r['err']:>9.1e}" if r["err"] is not None else f"{'n/a':>9}"
        print(f"{name:<20}{r['ms']:>11.1f}{ring['ms'] / r['ms']:>7.2f}{r['cpu_ms']:>7.0f}{err}"
              f"{r['fwd_send']:>11.2f}"
              f"{r['bwd_send']:>11.2f}{coll['all_gather']:>7.2f}{coll['reduce_scatter']:>7.2f}"
              f"{coll['all_to_all']:>7.2f}{r['peak_mb']:>8.1f}{r['fwd_send'] / ring['fwd_send']:>13.3f}")
    print("(MB sent per rank, mean over ranks; peak: live tensor MB per rank in one step, max over ranks)")
    return rows


def p2p_world(world: int) -> dict:
    with World(world, timeout=600, start_timeout=900) as w:
        per_rank = w.run(_p2p_bytes, 8, 1, 4, 8)
    ring_fwd = statistics.mean(r[1][0] for r in per_rank)
    print(f"\nP2P bytes sent per rank in the forward at P = {world}, over ring attention's (C = 1):")
    out = {}
    for c in valid_team_sizes(world):
        fwd = [r[c][0] for r in per_rank]
        paper = Layout(world, c).ring_len * 2 * c / (2 * world)  # G hops of 2C·A (with placement) / P of 2A
        out[c] = {"mean": statistics.mean(fwd) / ring_fwd, "max": max(fwd) / ring_fwd, "paper": paper}
        print(f"  C={c}: mean {out[c]['mean']:.3f}, max {out[c]['max']:.3f}; paper's count (placement on "
              f"every rank, ring P hops) {paper:.3f} = 1/C")
    return out


def projections() -> dict:
    """PROJECTIONS of the cost model with the paper's clusters as spec profiles (benchmarks.paper_check:
    public specs, nothing tuned): one attention layer fwd+bwd, GPT-7B-like heads (32 x 128, bf16, MHA,
    batch 1), the better of the two slot orders per C."""
    from benchmarks.paper_check import cluster

    print("\nPROJECTION (spec profiles, not a measurement): one attention layer fwd+bwd, "
          "32 heads x 128, bf16, batch 1")
    out = {}
    for name, (cl_name, world) in {"64x H100, 8/node, 8x400 Gb/s IB": ("H100_80GB_8", 64),
                                   "32x A100, 16/node, 100 Gb/s Ethernet": ("A100_40GB_16", 32)}.items():
        cl = cluster(cl_name, world)
        topo, nodes = cl.topology(), cl.nodes()
        print(f"  {name}:")
        for tokens in (65536, 131072, 262144, 524288):
            sh = Shard(tokens // world, 1, 32, 32, 128, 2, 4)
            t = {c: min(estimate(Layout(world, c, order(world, c)), sh, nodes, topo)
                        for order in ORDERS.values()) for c in valid_team_sizes(world)}
            best = min(t, key=t.get)
            out[f"{name} {tokens // 1024}K"] = round(t[1] / t[best], 3)
            print(f"    {tokens // 1024:>4}K tokens: "
                  + ", ".join(f"C={c} {1e3 * x:.1f} ms" for c, x in t.items())
                  + f"; best C={best}, {t[1] / t[best]:.2f}x ring")
    return out


def _fastest(rows: dict, names) -> str | None:
    return min(names, key=lambda n: rows[n]["ms"], default=None)


def _hybrid_summary(rows: dict, world: int) -> dict:
    """The best hybrid row, and the best with 1 < U < P, against DeepSpeed-Ulysses and WallFacer alone
    (the fastest of ring attention and every WallFacer row, kept or rebuilt): ratios of ms, > 1 = the
    hybrid is faster."""
    alone = rows[_fastest(rows, [n for n in rows if n.startswith(("wallfacer", "ring"))])]["ms"]
    hybrid = [n for n in rows if n.startswith("U=")]
    genuine = [n for n in hybrid if not n.startswith(f"U={world} ")]
    out = {}
    for key, names in (("best_hybrid", hybrid), ("best_hybrid_1<U<P", genuine)):
        best = _fastest(rows, names)
        ms = rows[best]["ms"] if best else None
        out[key] = best and {"name": best, "ulysses_ms_over_it": round(rows["ulysses"]["ms"] / ms, 3),
                             "wallfacer_alone_ms_over_it": round(alone / ms, 3)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--p2p-world", type=int, default=16, help="world for the P2P-bytes table (0: skip)")
    p.add_argument("--seq-per-rank", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--memory-world", type=int, default=8, help="world for the memory table (0: skip)")
    args = p.parse_args(argv)
    summary = {"load_before": _load()}
    for world in args.worlds:
        rows = run_world(world, args)
        wf = {n: r for n, r in rows.items() if n.startswith("wallfacer") and not n.endswith("keep")}
        best = min(wf, key=lambda n: wf[n]["ms"]) if wf else "ring (C=1)"
        ring, fastest = rows["ring (C=1)"], rows[best]["ms"]
        summary[f"P{world}"] = {
            "best": best,
            **_hybrid_summary(rows, world),
            "ring_ms_over_best_wallfacer_ms": round(ring["ms"] / fastest, 3),
            "ring_cpu_over_best_wallfacer_cpu": round(ring["cpu_ms"] / rows[best]["cpu_ms"], 3),
            "ulysses_ms_over_best_wallfacer_ms": round(rows["ulysses"]["ms"] / fastest, 3),
            "compute_only_ms_over_best_wallfacer_ms": round(rows["compute only"]["ms"] / fastest, 3),
            "p2p_fwd_over_ring": {n: round(r["fwd_send"] / ring["fwd_send"], 3) for n, r in wf.items()},
            "p2p_fwd_bwd_over_ring": {
                n: round((r["fwd_send"] + r["bwd_send"]) / (ring["fwd_send"] + ring["bwd_send"]), 3)
                for n, r in wf.items()},
        }
    if args.memory_world:
        summary[f"P{args.memory_world}_memory"] = memory_world(args.memory_world, args)
    if args.p2p_world:
        summary[f"P{args.p2p_world}_p2p_fwd_over_ring"] = {
            f"C={c}": round(v["mean"], 3) for c, v in p2p_world(args.p2p_world).items() if c > 1}
    summary["projection_ring_over_best"] = projections()
    summary["load_after"] = _load()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
