"""A rank's windows from ATLAS's plan, from measurement, or both; and how far the two differ.

A real run's window is a *wait instruction* of DeepSpeed's schedule (its tag: the instruction's index in
the iteration, :mod:`.engine`) with a start and a length. Two sources give them:

- **measurement** (:meth:`launch.bubbletea.engine.BubbleTea.measured_windows`): the instruction's time
  over the recent prefill-off iterations (median start, lower-quartile length);
- **the plan**: the iteration ATLAS simulated for its placement (:func:`launch.plan.simulate.simulate`,
  its ``Result.ops``: every forward and backward of every (stage, replica) row). :func:`plan_windows`
  maps the row's idle gaps onto the rank's instructions: DeepSpeed's ``TrainSchedule`` and the
  simulator's 1F1B run the same order of forwards and backwards on a stage (checked: a different order
  raises), so the k-th gap of the row (before its k-th compute op; the last one after its last) is the
  wait between the (k−1)-th and k-th ForwardPass/BackwardPass instructions. Of the waits there, the
  window goes to the receive (what a stage waits in before it can compute), else the last one.

``both``: the plan's windows until the rank has measured, then the measurement's, and for a wait the
measurement has not seen (below its floor, say) the plan's length times the rank's median ratio of
measured to planned length: the plan first, corrected by measurement. :func:`compare` reports the two
side by side per window and the rank's median relative difference.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from launch.bubbletea.timeline import Window

WAITS = frozenset({"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "AggregateLoss"})
COMPUTE = {"ForwardPass": "forward", "BackwardPass": "backward"}
SOURCES = ("measured", "plan", "both")


def instruction_names(micro_batches: int, stages: int, stage: int) -> list[str]:
    """The instructions one ``train_batch`` runs on ``stage``, in order, as the engine tags them:
    DeepSpeed's ``TrainSchedule`` steps, then the loss broadcast."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    steps = TrainSchedule(micro_batches, stages, stage).steps()
    names = [type(cmd).__name__ for step in steps for cmd in step]
    return [*names, "AggregateLoss"]


def plan_windows(ops: Sequence, iteration: float, row: tuple[int, int], names: Sequence[str],
                 lane=None) -> list[Window]:
    """The row's idle gaps in the plan's iteration (``ops``: :class:`launch.plan.timeline.Op`) as windows
    on the rank's wait instructions ``names`` (module docstring). Plan seconds, from the iteration start."""
    compute = sorted((op for op in ops if (op.stage, op.replica) == tuple(row) and op.kind in
                      ("forward", "backward")), key=lambda op: op.start)
    positions = [i for i, n in enumerate(names) if n in COMPUTE]
    planned, ran = [op.kind for op in compute], [COMPUTE[names[i]] for i in positions]
    if planned != ran:
        raise ValueError(f"plan_windows: row {tuple(row)}'s plan runs {_short(planned)} but the rank's "
                         f"schedule runs {_short(ran)}: not the same pipeline schedule")
    out = []
    bounds = [-1, *positions, len(names)]
    edges = [0.0] + [op.end for op in compute]
    for k in range(len(bounds) - 1):
        waits = [i for i in range(bounds[k] + 1, bounds[k + 1]) if names[i] in WAITS]
        if not waits:
            continue
        start = edges[k]
        end = compute[k].start if k < len(compute) else _tail_end(ops, row, iteration, start)
        if end <= start:
            continue
        receives = [i for i in waits if names[i].startswith("Recv")]
        tag = receives[-1] if receives else waits[-1]
        out.append(Window(lane, start, end, tag))
    return out


def _tail_end(ops, row, iteration: float, after: float) -> float:
    """The end of the row's last gap: its all-reduce's start if one follows, else the iteration's end."""
    later = [op.start for op in ops if (op.stage, op.replica) == tuple(row) and op.kind == "allreduce"
             and op.start >= after]
    return min(later, default=iteration)


def _short(kinds: list[str]) -> str:
    return "".join(k[0].upper() for k in kinds)


def combine(source: str, plan: Sequence[Window], measured: Sequence[Window]) -> list[Window]:
    """The windows ``source`` gives: ``measured``, ``plan``, or ``both`` (module docstring)."""
    if source not in SOURCES:
        raise ValueError(f"windows={source!r}: one of {', '.join(SOURCES)}")
    if source == "plan" or (source == "both" and not measured):
        return list(plan)
    if source == "measured":
        return list(measured)
    by_tag = {w.tag: w for w in measured}
    ratios = [by_tag[w.tag].length / w.length for w in plan if w.tag in by_tag and w.length > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    extra = [Window(w.lane, w.start, w.start + scale * w.length, w.tag) for w in plan if w.tag not in by_tag]
    return sorted([*measured, *extra], key=lambda w: w.start)


def compare(plan: Sequence[Window], measured: Sequence[Window]) -> dict:
    """Plan against measurement per window tag (ms), and the median of (measured − plan) / plan over the
    windows both have (None when none is shared)."""
    p, m = {w.tag: w.length for w in plan}, {w.tag: w.length for w in measured}
    rows = [{"tag": t, "plan_ms": _ms(p.get(t)), "measured_ms": _ms(m.get(t))} for t in sorted({*p, *m})]
    rel = [(m[t] - p[t]) / p[t] for t in p if t in m and p[t] > 0]
    return {"windows": rows, "median_rel_diff": statistics.median(rel) if rel else None,
            "plan_s": sum(p.values()), "measured_s": sum(m.values())}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 3)
