"""One iteration as data: the ops of every (stage, replica), their idle windows, a picture and a trace.

An :class:`Op` is one interval on one pipeline-stage replica ("row": the tp GPUs of stage s in data
parallel replica d, which run in lockstep). The simulator (:func:`launch.plan.simulate.simulate`) returns
them in ``Result.ops``:

    forward, backward   compute of one micro-batch
    allreduce           the stage's data-parallel gradient all-reduce at the end of the iteration
    send, recv          a WAN transfer leaving this row (first byte .. last byte) or reaching it
                        (first byte .. last byte, one latency later); asynchronous, so they overlap
                        compute and are drawn as a thin band under it
    prefill             inference work placed into the bubbles (BubbleTea adds these ops itself)

Idle windows (:func:`idle_windows`) are the gaps between the compute kinds (forward, backward,
allreduce, prefill) on a row within [0, iteration]: WAN transfers do not occupy the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

COMPUTE = ("forward", "backward", "allreduce", "prefill")
KINDS = (*COMPUTE, "send", "recv")
COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "allreduce": "#8172b2", "prefill": "#dd8452",
           "send": "#c44e52", "recv": "#e6a532", "idle": "#eeeeee"}


@dataclass(frozen=True, slots=True)
class Op:
    stage: int
    replica: int
    kind: str
    start: float          # seconds from the iteration's start
    end: float
    micro_batch: int | None = None

    @property
    def row(self) -> tuple[int, int]:
        return self.stage, self.replica


def rows(ops: Iterable[Op]) -> list[tuple[int, int]]:
    """Every (stage, replica) that has an op, stage-major."""
    return sorted({op.row for op in ops})


def idle_windows(ops: Sequence[Op], iteration: float) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """{(stage, replica): [(start, end), ...]}: the intervals of [0, iteration] with no compute op."""
    busy: dict[tuple[int, int], list[tuple[float, float]]] = {r: [] for r in rows(ops)}
    for op in ops:
        if op.kind in COMPUTE:
            busy[op.row].append((op.start, op.end))
    out = {}
    for row, spans in busy.items():
        gaps, t = [], 0.0
        for a, b in sorted(spans):
            if a > t:
                gaps.append((t, a))
            t = max(t, b)
        if iteration > t:
            gaps.append((t, iteration))
        out[row] = gaps
    return out


def chrome_trace(ops: Sequence[Op], labels: dict[tuple[int, int], str] | None = None) -> dict:
    """The ops as a Chrome trace (chrome://tracing, Perfetto): one thread per row, times in µs;
    WAN transfers on a second thread of the row, as they overlap compute."""
    events = []
    for i, row in enumerate(rows(ops)):
        name = (labels or {}).get(row, f"stage {row[0]} replica {row[1]}")
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 2 * i, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 2 * i + 1,
                       "args": {"name": f"{name} WAN"}})
        events += [{"ph": "X", "pid": 0, "tid": 2 * i + (op.kind in ("send", "recv")), "name": op.kind,
                    "cat": op.kind, "ts": op.start * 1e6, "dur": (op.end - op.start) * 1e6,
                    "args": {} if op.micro_batch is None else {"micro_batch": op.micro_batch}}
                   for op in ops if op.row == row]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, ops: Sequence[Op], labels=None) -> None:
    Path(path).write_text(json.dumps(chrome_trace(ops, labels)))


def draw(path: str | Path, ops: Sequence[Op], iteration: float, title: str = "",
         labels: dict[tuple[int, int], str] | None = None, max_rows: int = 32,
         window: tuple[float, float] | None = None) -> None:
    """A PNG with one row per (stage, replica) over one iteration (or ``window`` of it): compute as
    the upper bar, WAN send/receive as a band under it, idle as the light background. Beyond
    ``max_rows`` rows only replica 0 of each stage is drawn (the replicas of a stage look alike; the
    title says so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = rows(ops)
    note = ""
    if len(shown) > max_rows:
        shown = [r for r in shown if r[1] == 0][:max_rows]
        note = " (replica 0 of each stage)"
    index = {r: i for i, r in enumerate(shown)}
    lo, hi = window or (0.0, iteration)
    height = 1.3 + 0.3 * len(shown)
    fig, ax = plt.subplots(figsize=(11, height), dpi=80)
    by_kind: dict[str, list] = {}
    for op in ops:
        if op.row in index and op.end > lo and op.start < hi:
            by_kind.setdefault(op.kind, []).append(op)
    for i in range(len(shown)):
        ax.broken_barh([(0, iteration)], (i - 0.42, 0.84), color=COLOURS["idle"], linewidth=0)
    for kind, group in by_kind.items():
        band = (0.2, 0.2) if kind in ("send", "recv") else (-0.42, 0.6)   # (offset, height) in a row
        spans: dict[int, list] = {}
        for op in group:
            spans.setdefault(index[op.row], []).append((op.start, op.end - op.start))
        for i, xs in spans.items():   # a thin white edge keeps back-to-back ops apart
            ax.broken_barh(xs, (i + band[0], band[1]), facecolor=COLOURS[kind], edgecolor="white",
                           linewidth=0.3)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([(labels or {}).get(r, f"s{r[0]} r{r[1]}") for r in shown], fontsize=7)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("seconds into the iteration", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title + note, fontsize=9, pad=18)
    present = [k for k in KINDS if k in by_kind] + ["idle"]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in present], ncol=len(present),
              loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, frameon=False,
              handlelength=1.2, columnspacing=1.2, borderaxespad=0.1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
