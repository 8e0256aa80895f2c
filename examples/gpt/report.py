"""The side-by-side report: a table (stdout and table.md), a PNG chart and the files of one run directory.

runs/<timestamp>/
    config.json     the DeepSpeed config, the job's arguments and what the features-off run changed
    table.md        the table printed at the end
    results.json    per-run losses, held-out losses, step times, bytes per step by kind and group
    chart.png       loss curves of both runs; ms per step and bytes per step (by kind) as bars
    sample.txt      the bytes each run sampled after the same held-out prompt
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from examples.gpt.train import Result

KINDS = (("all_to_all", "all-to-all"), ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
         ("all_reduce", "all-reduce"), ("p2p", "send/recv"))


def by_kind(res: Result) -> dict[str, float]:
    """MB per step per rank for each column of the table (send and recv merged: sent bytes only)."""
    out = {label: 0.0 for _, label in KINDS}
    for kind, sent in res.sent.items():
        label = dict(KINDS).get("p2p" if kind in ("send", "recv") else kind, kind)
        out[label] = out.get(label, 0.0) + sent / 1e6
    return out


def _row(res: Result, what: str) -> str:
    mb = by_kind(res)
    cells = [f"{res.name}: {what}", f"{res.tokens_per_s:,.0f}", f"{res.ms_per_step:.0f}",
             *[f"{mb[label]:.2f}" for _, label in KINDS], f"{sum(mb.values()):.2f}",
             f"{res.losses[-1]:.4f}", f"{res.evals[-1][1]:.4f}"]
    return "| " + " | ".join(cells) + " |"


def table(results: list[tuple[Result, str]], tolerance, pipeline=None) -> str:
    """Markdown: the two runs (features off, on), how far their losses are apart, the speed-up; then the
    ``--atlas`` pipeline rows (a list of two rows) or why they are missing (a string)."""
    head = ["run", "tokens/s", "ms/step", *[f"{label} MB" for _, label in KINDS], "total MB", "train loss",
            "held-out loss"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows += [_row(res, what) for res, what in results]
    if isinstance(pipeline, list):
        rows += [_row(res, what) for res, what in pipeline]
    (a, _), (b, _) = results[0], results[1]
    rows += ["", f"after {len(a.losses)} steps: train loss {a.losses[-1]:.5f} vs {b.losses[-1]:.5f}, "
             f"held-out {a.evals[-1][1]:.5f} vs {b.evals[-1][1]:.5f}; {tolerance.describe(a, b)}",
             f"speed: {b.tokens_per_s / a.tokens_per_s:.2f}x tokens/s of {a.name}; bytes per step "
             f"{sum(by_kind(b).values()) / max(sum(by_kind(a).values()), 1e-12):.2f}x"]
    if isinstance(pipeline, list):
        (p, _), (q, _) = pipeline
        same = "identical" if p.losses == q.losses and p.evals == q.evals else "DIFFERENT"
        predicted = ""
        if getattr(p, "predicted_ms", 0) and getattr(q, "predicted_ms", 0):
            predicted = (f" (calibrated simulator: {p.predicted_ms:.0f} and {q.predicted_ms:.0f} ms/step, "
                         f"{p.predicted_ms / q.predicted_ms:.2f}x; with a free WAN {p.free_wan_ms:.0f} "
                         f"ms/step: stock waits {1 - p.free_wan_ms / p.predicted_ms:.0%} of its step on the "
                         "WAN)")
        rows.append(f"pipeline across 2 data centers (PP 2 x DP 2, {len(p.losses)} steps; not the model "
                    f"above: no context parallelism, other batches): ATLAS "
                    f"{q.tokens_per_s / p.tokens_per_s:.2f}x tokens/s of DeepSpeed's sends{predicted}; "
                    f"losses {same}")
    elif pipeline is not None:
        rows.append(f"pipeline across 2 data centers (--atlas): skipped: {pipeline}")
    return "\n".join(rows)


def chart(results: list[tuple[Result, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors, widths, styles = ["#8c8c8c", "#1f77b4"], [3.5, 1.4], ["-", "--"]
    fig, (ax_loss, ax_ms, ax_mb) = plt.subplots(1, 3, figsize=(13, 4.2), width_ratios=[2.2, 1, 1.5])
    for (res, _), color, lw, ls in zip(results, colors, widths, styles, strict=False):
        steps = range(1, len(res.losses) + 1)
        ax_loss.plot(steps, res.losses, ls, color=color, lw=lw / 3, alpha=0.6, label=f"{res.name} train")
        ax_loss.plot(*zip(*res.evals, strict=True), "o" + ls, color=color, lw=lw, ms=2 + lw,
                     label=f"{res.name} held-out")
    ax_loss.set(xlabel="step", ylabel="cross entropy (nats / byte)",
                title="loss of both runs (the curves overlap)")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    names = [res.name for res, _ in results]
    bars = ax_ms.bar(names, [res.ms_per_step for res, _ in results], color=colors[: len(results)], width=0.6)
    ax_ms.bar_label(bars, fmt="%.0f ms", fontsize=8)
    ax_ms.set(ylabel="ms per step (median, slowest rank)", title="time per step")
    bottom = [0.0] * len(results)
    for (_, label), shade in zip(KINDS, ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"], strict=True):
        values = [by_kind(res)[label] for res, _ in results]
        ax_mb.bar(names, values, bottom=bottom, color=shade, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in enumerate(bottom):
        ax_mb.annotate(f"{total:.1f} MB", (x, total), ha="center", va="bottom", fontsize=8)
    ax_mb.set(ylabel="MB sent per rank per step", title="communication by kind")
    ax_mb.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in (ax_ms, ax_mb):
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(out_root: Path, results: list[tuple[Result, str]], config: dict, text: str, pipeline=None) -> Path:
    """Create runs/<timestamp>/ under ``out_root`` and write the five files; returns the directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = out_root / stamp
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = out_root / f"{stamp}-{n}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (run_dir / "table.md").write_text(text + "\n")
    rows = results + (pipeline if isinstance(pipeline, list) else [])
    summary = {res.name: {**asdict(res), "sample": res.sample.decode("utf-8", "replace"), "what": what,
                          "ms_per_step": res.ms_per_step, "tokens_per_s": res.tokens_per_s}
               for res, what in rows}
    (run_dir / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (run_dir / "sample.txt").write_text("".join(
        f"--- {res.name} ---\n{res.sample.decode('utf-8', 'replace')}\n" for res, _ in results))
    chart(results, run_dir / "chart.png")
    return run_dir
