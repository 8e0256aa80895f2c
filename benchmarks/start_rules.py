"""``python -m benchmarks.bubbletea --tail-quantile A --versus-quantile B``: two start rules in one run.

Separate runs of the two rules (``--tail-quantile 0`` then ``0.9``) compare two machines: on a 2-core
box shared with other jobs the load drifts by tens between runs, more than the rules differ. Here the
*on* iteration of every cycle (stock / on / profile, benchmarks.bubbletea) runs under one rule or the
other (:meth:`launch.bubbletea.server.PrefillServer.set_tail_quantile` before its plan; the service keeps
its recent chunk samples, so both rules price on the same machine state), and each rule's on iterations
are paired with their own cycle's stock iteration, as the single-rule slowdown is.

Which rule a cycle gets (:func:`rule_of`): cycle i runs rule ``(i + i // 6) % 2``, so the rules alternate
cycle by cycle (drift slower than two cycles, ~0.7 s, hits both alike) and, because the 6 arm orders
repeat every 6 cycles while the rule pattern flips every 6, each rule meets every arm order once per 12
cycles. Cycles 2k and 2k + 1 always carry different rules: their on/stock ratios' difference is one
paired sample of "rule A minus rule B" (:func:`paired_difference`).

A chunk belongs to the rule in force when it *started* (its t0 lies inside that on iteration; chunks
start only while a window of an on iteration is open, :func:`attribute`); a chunk that runs past its
iteration's end is still its starter's. Late: it ended after its window's planned end; over its tail
cost: it ran longer than the start rule priced it (the rule's own calibration: for the mean rule about
half the chunks, for p90 about one in ten).
"""

from __future__ import annotations

import statistics

ORDERS = 6          # benchmarks.bubbletea's arm orders (the permutations of stock / on / profile)


def rule_of(cycle: int, rules: tuple) -> object:
    """The rule of ``cycle``: alternating cycle by cycle, the pattern flipped every ``ORDERS`` cycles."""
    return rules[(cycle + cycle // ORDERS) % 2]


def rules_from(cfg: dict) -> tuple | None:
    """The benchmark's options as the two rules its cycles alternate (``--tail-quantile``'s first, None
    for the mean cost), or None without ``--versus-quantile`` (one rule, no comparison)."""
    if cfg.get("versus_quantile") is None:
        return None
    return cfg["tail_quantile"] or None, cfg["versus_quantile"] or None


def check_pairs(pairs: int) -> None:
    """Two rules need whole 12-cycle rounds: each rule then meets every arm order equally often."""
    if pairs % (2 * ORDERS):
        raise ValueError(f"--pairs={pairs} with --versus-quantile: a multiple of {2 * ORDERS} (each rule "
                         f"meets each of the {ORDERS} arm orders once per {2 * ORDERS} cycles)")


def attribute(chunks, spans) -> list[dict]:
    """Per rule (the spans' order of first appearance), the chunks that started inside its on iterations.

    ``chunks``: (t0, t1, tokens, predicted, tail, deadline) per chunk (``PrefillServer.stats.timings``);
    ``spans``: (start, end, rule) per on iteration, perf_counter seconds. Returns, per rule, its rule,
    chunks, tokens, late (ended after a nonzero deadline), late_s, over_tail (t1 - t0 > tail), wall (its
    iterations' seconds) and tokens_per_s."""
    rules: dict = {}
    for start, end, rule in spans:
        r = rules.setdefault(rule, {"rule": rule, "chunks": 0, "tokens": 0, "late": 0, "late_s": 0.0,
                                    "over_tail": 0, "wall": 0.0})
        r["wall"] += end - start
    ordered = sorted(spans)
    for t0, t1, tokens, _predicted, tail, deadline in chunks:
        span = next((s for s in ordered if s[0] <= t0 <= s[1]), None)
        if span is None:                  # started outside the compared iterations (warm-up, steady)
            continue
        r = rules[span[2]]
        r["chunks"] += 1
        r["tokens"] += tokens
        r["over_tail"] += t1 - t0 > tail
        if deadline and t1 > deadline:
            r["late"] += 1
            r["late_s"] += t1 - deadline
    out = list(rules.values())
    for r in out:
        r["tokens_per_s"] = r["tokens"] / r["wall"] if r["wall"] > 0 else 0.0
    return out


def _quartiles(xs: list[float]) -> list[float]:
    return statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3


def paired_difference(ratios: list[float], cycle_rules: list, rules: tuple) -> list[float]:
    """Per pair of cycles (2k, 2k + 1): rule A's on/stock ratio minus rule B's (in points of the step)."""
    out = []
    for k in range(0, len(ratios) - 1, 2):
        by = dict(zip(cycle_rules[k:k + 2], ratios[k:k + 2], strict=True))
        out.append(by[rules[0]] - by[rules[1]])
    return out


def name(rule) -> str:
    return "mean" if rule is None else f"p{100 * rule:g}"


def compare(ranks: list[dict], rules: tuple) -> dict:
    """The two rules side by side: per rule the slowdown (median of its on/stock pairs; quartiles; per
    rank), per rank its chunks, late and over-tail counts and tokens/s; and the paired difference A - B
    (median, quartiles) of rank 0. Prints a table; returns the figures."""
    per_rule = []
    for rule in rules:
        row = {"rule": name(rule), "slowdown_per_rank": [], "ranks": []}
        for r in ranks:
            ratios = [on / st for on, st, c in zip(r["on"], r["stock"], r["cycle_rules"], strict=True)
                      if c == rule]
            q = _quartiles(ratios)
            row["slowdown_per_rank"].append(statistics.median(ratios) - 1)
            if r is ranks[0]:
                row.update(slowdown=statistics.median(ratios) - 1, quartiles=[x - 1 for x in q],
                           cycles=len(ratios))
            row["ranks"].append(next(x for x in r["rules"] if x["rule"] == rule))
        row["tokens_per_s"] = sum(x["tokens_per_s"] for x in row["ranks"])
        per_rule.append(row)
    r0 = ranks[0]
    diff = paired_difference([on / st for on, st in zip(r0["on"], r0["stock"], strict=True)],
                             r0["cycle_rules"], rules)
    dq = _quartiles(diff)
    a, b = (name(x) for x in rules)
    print()
    print(f"Start rules in one run, alternating cycle by cycle ({per_rule[0]['cycles']} cycles each):")
    print("| rule | slowdown rank 0 (quartiles) | per rank | prefill tokens/s (per rank) | "
          "late chunks per rank | over their tail cost per rank |")
    print("|---|---|---|---|---|---|")
    for row in per_rule:
        q = row["quartiles"]
        print(f"| {row['rule']} | {100 * row['slowdown']:+.2f}% ({100 * q[0]:+.1f} .. {100 * q[2]:+.1f}) | "
              + ", ".join(f"{100 * x:+.2f}%" for x in row["slowdown_per_rank"])
              + f" | {row['tokens_per_s']:,.0f} ("
              + " / ".join(f"{x['tokens_per_s']:,.0f}" for x in row["ranks"]) + ") | "
              + ", ".join(f"{x['late']}/{x['chunks']} ({1e3 * x['late_s']:.1f} ms)" for x in row["ranks"])
              + " | " + ", ".join(f"{x['over_tail']}/{x['chunks']}" for x in row["ranks"]) + " |")
    print(f"paired {a} - {b} (cycles 2k, 2k+1; rank 0): median {100 * statistics.median(diff):+.2f} pt "
          f"(quartiles {100 * dq[0]:+.2f} .. {100 * dq[2]:+.2f}), {len(diff)} pairs")
    return {"rules": per_rule, "paired_difference": statistics.median(diff),
            "paired_difference_quartiles": dq, "pairs": len(diff)}
