"""The report of ``python -m benchmarks.bubbletea``: from every rank's measurements
(:func:`benchmarks.bubbletea_rank.bench_rank`) the step time of each arm, the slowdown (the median over
cycles of rank 0's paired on / stock step times; per rank too), the A/A control (tracing only / stock:
the noise floor), utilisation, prefill tokens/s and time to first token; then per rank its service's
counters, share of the prefill, chunks against their windows and training, plan against measurement
and starvation (:func:`rank_table`). Prints tables and ends with one JSON line of the figures.

Utilisation per rank is (training compute + prefill) / wall time of the iteration, union of spans;
training compute counts every instruction but the pipeline waits (sends, receives, the loss broadcast).
"""

from __future__ import annotations

import json
import statistics

from benchmarks.bubbletea_rank import median
from benchmarks.start_rules import compare, rules_from


def model_name(cfg: dict) -> str:
    if cfg.get("hf_tiny"):
        return f"Hugging Face {cfg['hf_tiny']} (random) hidden {cfg['lm_hidden']} x {cfg['lm_layers']} layers"
    if cfg.get("hf"):
        return f"Hugging Face model {cfg['hf']}"
    return f"LM hidden {cfg['lm_hidden']} x {cfg['lm_layers']} layers"


def report(cfg: dict, ranks: list[dict], load_before: str, load_after: str) -> dict:
    r0 = ranks[0]
    ratios = [a / b for a, b in zip(r0["on"], r0["stock"], strict=True)]
    control = [a / b for a, b in zip(r0["profile"], r0["stock"], strict=True)]   # A/A: the noise floor
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    per_rank_ratio = [median([a / b for a, b in zip(r["on"], r["stock"], strict=True)]) for r in ranks]
    stock, on, prof = median(r0["stock"]), median(r0["on"]), median(r0["profile"])
    util_off = statistics.mean(r["util_off"] for r in ranks)
    util_on = statistics.mean(r["util_on"] for r in ranks)
    # pipelined, each stage runs every token: the prefill done is the last stage's
    tok_s = sum(r["tokens_per_s"] for r in ranks if not cfg["pipelined"] or r["last"])
    ttft = sorted(t for r in ranks for t in r["ttft"])
    p90 = ttft[int(0.9 * (len(ttft) - 1))] if ttft else float("nan")
    binding = (f"each bound to its own {len(cfg['cores'][0])} core(s) with its prefill service"
               if cfg["cores"] else f"unbound, on {cfg['cpus']} cores")
    replicas = f"{len(ranks) // 2} replica{'s' * (len(ranks) > 2)}"
    print(f"BubbleTea, {len(ranks)} CPU ranks (2 stages x {replicas}, {binding}), "
          f"emulated WAN {cfg['wan_ms']:g} ms one way; "
          f"training {cfg['layers']} x Linear({cfg['hidden']}) + Tanh, {cfg['micro_batches']} micro-batches "
          f"of {cfg['batch']}; prefill {model_name(cfg)}, prompts of "
          f"{cfg['prompt']} tokens in chunks of {cfg['chunk']}, {cfg['outstanding']} queued per rank, "
          + ("chunks SLEEPING (no work), " if cfg.get("sleeping_chunks") else "") +
          f"guard {cfg['guard_ms']:g} ms, start rule on the "
          + (f"p{100 * cfg['tail_quantile']:g} cost" if cfg["tail_quantile"] else "mean cost")
          + (" and, every other cycle, on the " + ("mean cost" if not cfg["versus_quantile"] else
                                                   f"p{100 * cfg['versus_quantile']:g} cost")
             if rules_from(cfg) else "")
          + f"; nice: training {cfg['nice']}, prefill {cfg['prefill_nice']}"
          + (" + SCHED_IDLE" if cfg["prefill_idle"] else ""))
    print(f"load average before {load_before}, after {load_after}; {cfg['pairs']} cycles "
          f"(stock / on / profile, in their 6 orders in turn), {r0['steady_iterations']} steady iterations")
    print()
    print("| | step time (median, s) | GPU utilisation | prefill tokens/s | TTFT median / p90 (s) |")
    print("|---|---|---|---|---|")
    print(f"| DeepSpeed (stock engine) | {stock:.4f} | {100 * util_off:.1f}% (traced) | - | - |")
    print(f"| BubbleTea, tracing only | {prof:.4f} | {100 * util_off:.1f}% | - | - |")
    print(f"| BubbleTea, prefill on | {on:.4f} | {100 * util_on:.1f}% | {tok_s:.0f} | "
          f"{median(ttft):.3f} / {p90:.3f} |")
    print()
    print(f"slowdown (median of paired on/stock, rank 0): {100 * (median(ratios) - 1):+.2f}% "
          f"(quartiles {100 * (q[0] - 1):+.1f}% .. {100 * (q[2] - 1):+.1f}%); per rank "
          + ", ".join(f"{100 * (x - 1):+.2f}%" for x in per_rank_ratio))
    print(f"noise floor (median of paired tracing-only/stock, rank 0): {100 * (median(control) - 1):+.2f}%")
    print("per rank: " + "; ".join(
        f"rank {r['rank']}: prefill {r['prefill_busy_on'] / r['wall_on']:.0%} + training "
        f"{r['train_busy_on'] / r['wall_on']:.0%} of on-iterations, {r['prefilled']} prompts, "
        f"{r['chunks']} chunks "
        f"(planned, not started: {r['skipped']} too long for the rest of their window, {r['closed']} after "
        f"an early close), windows (instr, ms) {r['windows']}" for r in ranks))
    per_rank = rank_table(cfg, ranks)
    summary = {"ranks": len(ranks), "bound": bool(cfg["cores"]), "atlas": cfg["atlas"],
               "tail_quantile": cfg["tail_quantile"] or None,
               "pipelined": cfg["pipelined"], "windows": cfg["windows"], "per_rank": per_rank,
               "starved_ranks": [r["rank"] for r in per_rank if r["starved"]],
               "slowdown": median(ratios) - 1, "slowdown_per_rank": [x - 1 for x in per_rank_ratio],
               "tracing_overhead": median(control) - 1,
               "step_s_stock": stock, "step_s_bubbletea": on, "step_s_tracing": prof,
               "utilisation": util_off, "utilisation_bubbletea": util_on, "prefill_tokens_per_s": tok_s,
               "ttft_median_s": median(ttft), "ttft_p90_s": p90, "load": [load_before, load_after]}
    if rules_from(cfg):
        summary["start_rules"] = compare(ranks, rules_from(cfg))
    print(json.dumps(summary))
    return summary


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def rank_table(cfg: dict, ranks: list[dict]) -> list[dict]:
    """Per rank: its service's counters, its share of the prefill, its slowdown, plan vs measurement;
    prints the table and a warning for a starved rank (a share under half the even share, or no chunk)."""
    # pipelined, every stage runs every token: a stage's share is of the stage that ran the most
    tokens = max(r["tokens"] for r in ranks) if cfg["pipelined"] else sum(r["tokens"] for r in ranks)
    even = 1.0 if cfg["pipelined"] else 1.0 / len(ranks)
    rows = []
    for r in ranks:
        c, w = r["counters"], r["window_report"]
        share = r["tokens"] / tokens if tokens else 0.0
        rows.append({"rank": r["rank"], "chunks": r["chunks"], "tokens": r["tokens"], "share": share,
                     "prompts": r["prefilled"], "queue": c["queue"], "queue_peak": c["queue_peak"],
                     "ttft_median_s": median(r["ttft"]) if r["ttft"] else None,
                     "tokens_per_s": r["tokens_per_s"],
                     "slowdown": median([a / b for a, b in zip(r["on"], r["stock"], strict=True)]) - 1,
                     "plan_vs_measured": w["median_rel_diff"], "plan_s": w["plan_s"],
                     "measured_s": w["measured_s"], "plan_windows": w.get("windows", []),
                     "recalibrated": c["recalibrated"], "kv_cap": r["memory"].get("cap"),
                     "late": c["late"], "late_ms": 1e3 * c["late_s"], "over_tail": c["over_tail"],
                     "cost_ratio_median": c["cost_ratio_median"], "cost_ratio_p90": c["cost_ratio_p90"],
                     "time": r["time"], "gc": r["gc"],
                     "kv_peak": r["memory"].get("kv_peak"),
                     "dry_s": r.get("dry_s", 0.0), "dry_iterations": r.get("dry_iterations", 0),
                     "on_iterations": r.get("on_iterations", 0), "restarts": r.get("starved", 0),
                     "starved": r["chunks"] == 0 or share < 0.5 * even})
    print()
    print(f"| rank | chunks | tokens (share) | prompts | queue end / peak | TTFT median | prefill tokens/s | "
          f"slowdown | windows ({cfg['windows']}): plan / measured, median diff | KV peak / cap |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        diff = "-" if x["plan_vs_measured"] is None else f"{100 * x['plan_vs_measured']:+.0f}%"
        ttft = "-" if x["ttft_median_s"] is None else f"{x['ttft_median_s']:.3f} s"
        print(f"| {x['rank']} | {x['chunks']} | {x['tokens']} ({100 * x['share']:.0f}%) | {x['prompts']} | "
              f"{x['queue']} / {x['queue_peak']} | {ttft} | {x['tokens_per_s']:,.0f} | "
              f"{100 * x['slowdown']:+.2f}% | {1e3 * x['plan_s']:.1f} / {1e3 * x['measured_s']:.1f} ms, "
              f"{diff} | "
              f"{(x['kv_peak'] or 0) / 2**20:.1f} / {(x['kv_cap'] or 0) / 2**30:.1f} GiB |")
    print()
    print("Chunks against their windows and training, per rank: late = ended after its window's planned end; "
          "into training = still running when the wait it started in returned; measured / predicted cost. "
          "Then ms per iteration by instruction, prefill off -> on (median).")
    for x in rows:
        t = x["time"]
        ratio = ("-" if x["cost_ratio_median"] is None else
                 f"{x['cost_ratio_median']:.2f} / {x['cost_ratio_p90']:.2f}")
        print(f"rank {x['rank']}: late {x['late']} of {x['chunks']} ({x['late_ms']:.1f} ms), over their "
              f"tail cost {x['over_tail']}, into training "
              f"{t['into_training']} ({t['into_training_ms']:.1f} ms), measured/predicted median / p90 "
              f"{ratio}; " + ", ".join(f"{k} {a:.1f} -> {b:.1f}" for k, (a, b) in t["ms"].items())
              + "; iteration ms (count): "
              + ", ".join(f"{k} {a:.1f} ({n})" for k, (a, n) in t["wall_ms"].items())
              + "; garbage collector (ms in all, full collections, longest ms): "
              + ", ".join(f"{arm} {ms:.1f} / {n} / {top:.1f}" for arm, (ms, n, top) in x["gc"].items())
              + "; iterations with a chunk into training, instructions 2 ms over their usual: "
              + str(t["into_slow"]))
    if cfg["windows"] != "measured":
        print("Windows per rank, plan / measured ms by instruction (tag): " + "; ".join(
            f"rank {x['rank']}: " + ", ".join(f"{w['tag']}: {_ms(w['plan_ms'])} / {_ms(w['measured_ms'])}"
                                              for w in x["plan_windows"]) for x in rows))
    print("Starvation per rank (prefill-on iterations with prompts queued and no chunk run; the service "
          "re-timed after 8 in a row): " + "; ".join(
              f"rank {x['rank']}: {x['dry_iterations']} of {x['on_iterations']} iterations, "
              f"{x['dry_s']:.2f} s, re-timed {x['restarts']}x" for x in rows))
    for x in rows:
        if x["starved"]:
            print(f"WARNING: rank {x['rank']}'s prefill service is starved: {x['chunks']} chunks, "
                  f"{100 * x['share']:.0f}% of the prefilled tokens (even share {100 * even:.0f}%), "
                  f"{x['dry_s']:.2f} s of prefill-on iterations without a chunk")
    return rows
