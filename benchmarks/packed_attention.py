"""Packed batches vs the same tokens as one dense causal sequence, under sequence parallelism on CPU ranks:

    python -m benchmarks.packed_attention                      # P = 4 and 8
    python -m benchmarks.packed_attention --worlds 4 --reps 9  # one world, more rounds

One batch of documents (lengths log-uniform in [--min-doc, N/2], seeded; N = P x --seq-per-rank tokens, so
that the dense zigzag is defined on the same stream) goes through wallfacer_attention twice per method:
packed (``packed_seq_params``: every document attends only itself, per-document zigzag rows, packing.py)
and dense (the whole stream as one causal sequence, Megatron's zigzag rows). Methods: WallFacer with the
largest valid C, ring attention (C = 1), the Ulysses hybrid U = 2 (with C = 1, and C = 2 where P/2 allows).

Timing: median over rounds (rows interleaved within a round, each round starting one row later) of the
slowest rank's wall time and of the CPU time of a rank's process (mean over ranks); the error is the packed
output against fp64 attention inside each document on the same rows. Then, from the layouts alone
(rowmap.rank_scores — tests/megatron_patches/test_packed.py counts the same scores in the kernel calls):
the balance table — every rank's causal scores per layout, per-document zigzag (this code), Megatron's
dense zigzag applied to the packed stream, contiguous — with the scores a dense causal schedule would
compute on those rows and the share skipped (pairs of two documents), the kernel calls per rank, and the
padding each layout needs against TransformerEngine's (every document rounded to a multiple of 2P).
The last line is JSON: packed/dense time per method, the balance, the padding.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics

import torch
import torch.distributed as dist

from benchmarks.packed_check import document_attention
from benchmarks.rounds import interleaved
from commweave.world import World
from megatron_patches import packing
from megatron_patches.hybrid import outer_shards
from megatron_patches.layout import Layout, valid_team_sizes
from megatron_patches.rowmap import block_calls, rank_scores, team_rows
from megatron_patches.wallfacer import wallfacer_attention


def document_lengths(total: int, low: int, seed: int = 0) -> list[int]:
    """Log-uniform lengths in [low, total/2] summing to ``total`` (the last one cut to fit)."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(int(2 ** rng.uniform(low.bit_length() - 1, (total // 2).bit_length() - 1)),
                       total - sum(out)))
    return out


def _params(lengths):
    from types import SimpleNamespace

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
                           cu_seqlens_kv_padded=None, local_cp_size=None, cp_group=None)


def _methods(world: int) -> dict[str, dict]:
    c = max(valid_team_sizes(world))
    out = {f"wallfacer C={c}": {"team_size": c}, "ring (C=1)": {"team_size": 1}}
    for cc in reversed(valid_team_sizes(world // 2)):
        out[f"U=2 C={cc}"] = {"team_size": cc, "ulysses_size": 2}
    return out


def _measure(lengths, b: int, h: int, d: int, rounds: int):
    """On every rank: the packed error, then ``rounds`` interleaved timed steps of every (method, form)."""
    world, me = dist.get_world_size(), dist.get_rank()
    group, ps = dist.group.WORLD, _params(lengths)
    pack = packing.from_packed_seq_params(ps)
    n = sum(lengths)
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(n, b, h, d) for _ in range(4))
    packed_rows = torch.tensor(packing.rank_index(packing.shards(pack, "zigzag", world)[me]))
    dense_rows = torch.tensor(packing.rank_index(packing.shards(packing.dense(n), "zigzag", world)[me]))
    want = torch.empty(n, b, h, d, dtype=torch.float64)  # attention inside each document, fp64
    for first, m, _ in pack.spans:
        doc = slice(first, first + m)
        want[doc] = document_attention(*(t[doc].double() for t in (q, k, v)), torch.zeros(m), d ** -0.5)
    want = want[packed_rows]
    out = {}
    for name, kw in _methods(world).items():
        forms = (("packed", packed_rows, {"packed_seq_params": ps}), ("dense", dense_rows, {}))
        for form, rows, extra in forms:
            ins = [t[rows].clone().requires_grad_() for t in (q, k, v)]

            def step(ins=ins, kw=kw, extra=extra, grad=g[rows]):
                o = wallfacer_attention(*ins, group, check=False, **kw, **extra)
                o.backward(grad)
                return o

            o = step()
            err = (o.detach().double() - want).abs().max().item() if form == "packed" else None
            out[name, form] = {"err": err, "step": step, "times": [], "cpu": []}
    interleaved(out, rounds)
    return out


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_world(world: int, lengths: list[int], args) -> dict:
    with World(world, timeout=1800, start_timeout=900) as w:
        per_rank = w.run(_measure, lengths, args.batch, args.heads, args.head_dim, args.reps + 1)
    rows = {}
    for key in per_rank[0]:
        slowest = [max(r[key]["times"][i] for r in per_rank) for i in range(1, args.reps + 1)]
        cpu = [statistics.mean(r[key]["cpu"][i] for r in per_rank) for i in range(1, args.reps + 1)]
        errs = [r[key]["err"] for r in per_rank if r[key]["err"] is not None]
        rows[key] = {"ms": 1e3 * statistics.median(slowest), "cpu_ms": 1e3 * statistics.median(cpu),
                     "err": max(errs) if errs else None}
    pack = packing.from_cu_seqlens([0, *torch.tensor(lengths).cumsum(0).tolist()])
    share = packing.causal_work(pack) / (sum(lengths) * (sum(lengths) + 1) // 2)
    print(f"\nP = {world} ranks, {len(lengths)} documents of {min(lengths)} … {max(lengths)} tokens, N = "
          f"{sum(lengths)}, b = {args.batch}, {args.heads} heads x {args.head_dim}, fp32; packed scores "
          f"{share:.3f} of dense causal; median of {args.reps} rounds; load {_load()}")
    print(f"{'method':<14}{'packed ms':>10}{'dense ms':>10}{'packed/dense':>13}{'cpu packed':>11}"
          f"{'cpu dense':>10}{'packed err':>11}")
    out = {}
    for name in _methods(world):
        p, dn = rows[name, "packed"], rows[name, "dense"]
        out[name] = round(p["ms"] / dn["ms"], 3)
        print(f"{name:<14}{p['ms']:>10.1f}{dn['ms']:>10.1f}{p['ms'] / dn['ms']:>13.3f}{p['cpu_ms']:>11.0f}"
              f"{dn['cpu_ms']:>10.0f}{p['err']:>11.1e}")
    cpu = {name: round(rows[name, "packed"]["cpu_ms"] / rows[name, "dense"]["cpu_ms"], 3)
           for name in _methods(world)}
    return {"packed_over_dense_ms": out, "packed_over_dense_cpu": cpu}


def stream_zigzag(pack: packing.Packing, world: int) -> tuple:
    """Megatron's dense zigzag (get_batch_on_this_cp_rank) applied to the packed stream as it is: each rank's
    two chunks of the whole stream, cut where documents end (runs as packing.shards gives them)."""
    out = []
    for runs in packing.shards(packing.dense(pack.total), "zigzag", world):
        mine = []
        for start, n, _ in runs:
            for doc, (first, valid, _) in enumerate(pack.spans):
                a, z = max(start, first), min(start + n, first + valid)
                if a < z:
                    mine.append((a, z - a, doc))
        out.append(packing.merge_runs(mine))
    return tuple(out)


def _calls(shards, lay) -> list[int]:
    rows = [team_rows(tuple(shards[r] for r in lay.team_ranks(t))) for t in range(lay.teams)]
    return [sum(len(block_calls(rows[lay.team_of(r)], rows[lay.kv_team(r, i)], True,
                                lay.team_of(r) == lay.kv_team(r, i))) for i in range(lay.ring_len))
            for r in range(lay.world)]


def balance(lengths: list[int], world: int) -> dict:
    """The balance table of one batch on ``world`` ranks (module docstring); returns max/mean per row."""
    pack = packing.from_cu_seqlens([0, *torch.tensor(lengths).cumsum(0).tolist()])
    dense = packing.dense(pack.total)
    layouts = {"per-document zigzag": packing.shards(pack, "zigzag", world),
               "stream zigzag": stream_zigzag(pack, world),
               "contiguous": packing.shards(pack, "contiguous", world)}
    dense_shards = {"per-document zigzag": packing.shards(dense, "zigzag", world),
                    "stream zigzag": packing.shards(dense, "zigzag", world),
                    "contiguous": packing.shards(dense, "contiguous", world)}
    te = sum(-n % (2 * world) for n in lengths)
    print(f"\nbalance, P = {world}: causal scores per rank (thousands); 'dense' = the scores a dense causal "
          f"schedule computes on the same rows, 'skipped' = the share of them between two documents")
    print(f"{'layout':<22}{'U x C':>6}{'min':>9}{'max':>9}{'mean':>9}{'max/mean':>9}{'dense':>9}"
          f"{'skipped':>8}{'calls/rank':>11}")
    out = {}
    for name, shards in layouts.items():
        for u in (1, 2):
            inner = outer_shards(shards, u) if u > 1 else shards
            dense_inner = outer_shards(dense_shards[name], u) if u > 1 else dense_shards[name]
            for c in valid_team_sizes(world // u):
                lay = Layout(world // u, c)
                work, full = rank_scores(inner, lay), rank_scores(dense_inner, lay)
                mean = statistics.mean(work)
                skipped = 1 - sum(work) / sum(full)
                calls = _calls(inner, lay)
                print(f"{name:<22}{f'{u}x{c}':>6}{min(work) / 1e3:>9.1f}{max(work) / 1e3:>9.1f}"
                      f"{mean / 1e3:>9.1f}{max(work) / mean:>9.3f}{statistics.mean(full) / 1e3:>9.1f}"
                      f"{skipped:>8.1%}{statistics.mean(calls):>11.1f}")
                out[f"{name} U={u} C={c}"] = round(max(work) / mean, 4)
    print(f"padding rows: per-document zigzag {packing.padding(pack, world)}, TE's per-document rounding "
          f"to 2P {te} ({te / pack.total:.1%} of the tokens), stream zigzag 0 (N divides by 2P)")
    return {"max_over_mean": out, "padding": packing.padding(pack, world), "te_padding": te}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-per-rank", type=int, default=1024)
    p.add_argument("--min-doc", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    summary = {"load_before": _load()}
    for world in args.worlds:
        lengths = document_lengths(world * args.seq_per_rank, args.min_doc, args.seed)
        summary[f"P{world}"] = {**run_world(world, lengths, args), "balance": balance(lengths, world)}
    summary["load_after"] = _load()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
