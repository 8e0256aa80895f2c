"""A rank's windows from ATLAS's plan, from measurement, or both; and how far the two differ.

A real run's window is a *wait instruction* of DeepSpeed's schedule (its tag: the instruction's index in
the iteration, :mod:`.engine`) with a start and a length. Two sources give them:

- **measurement** (:meth:`launch.bubbletea.engine.BubbleTea.measured_windows`): the instruction's time
  over the recent prefill-off iterations (median start, lower-quartile length);
- **the plan**: ATLAS's job (:class:`launch.plan.simulate.Job`: its stages' compute times, routes,
  micro-batches) simulated as the training engine runs it (:func:`engine_plan`: ``schedule=engine``,
  the blocking executor of :mod:`launch.plan.deepspeed_schedule` on DeepSpeed's ``TrainSchedule`` order
  or on Megatron-LM's 1F1B, :mod:`launch.plan.megatron_schedule`), its ``Result.ops`` (every forward and
  backward of every (stage, replica) row). A real run's BubbleTea wraps DeepSpeed's engine
  (:mod:`.engine`), so its windows come from DeepSpeed's order; the what-if on an ATLAS plan
  (:func:`launch.bubbletea.simulate.for_plan`) runs the order of the engine the plan was made for.
  :func:`plan_windows` maps the row's idle gaps onto the rank's instructions: the executor runs
  DeepSpeed's ``TrainSchedule`` (checked: a plan of another order raises), so the k-th gap of the row
  (before its k-th compute op; the last one after its last) is the wait between the (k−1)-th and k-th
  ForwardPass/BackwardPass instructions. Of the waits there, the window goes to the receive (what a
  stage waits in before it can compute), else the last one.

  Why DeepSpeed's executor and not the idealised 1F1B the planner ranks placements with: DeepSpeed's
  p2p is blocking and its instruction order sends micro-batch m's activation only after receiving
  micro-batch m − 1's gradient, so with 2 stages stage 0 waits a WAN round trip plus stage 1's forward
  and backward for every micro-batch. The 1F1B simulation overlaps those transfers with stage 0's own
  forwards and gave stage 0 half the bubble it has (benchmarks.bubbletea, 10 ms one way, 4 micro-
  batches: 1F1B 45.7 ms of windows on stage 0 against 84-92 ms measured; the executor 86.2 ms).

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


def engine_plan(job, engine: str = "deepspeed"):
    """ATLAS's ``job`` (a :class:`launch.plan.simulate.Job`, or a ``Pipeline``) as ``engine`` (one of
    :data:`launch.plan.simulate.ENGINES`) runs it: :func:`launch.plan.simulate.simulate` with
    ``schedule=engine`` (module docstring), whatever schedule the job carried; the result's ``ops`` and
    ``iteration`` are what :func:`plan_windows` reads."""
    import dataclasses

    from launch.plan.simulate import ENGINES, Pipeline, simulate

    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: one of {', '.join(ENGINES)}")
    job = job.job() if isinstance(job, Pipeline) else job
    return simulate(dataclasses.replace(job, schedule=engine))


def plan_windows(ops: Sequence, iteration: float, row: tuple[int, int], names: Sequence[str],
                 lane=None, transfers: Sequence = (), step_sync: bool = False) -> list[Window]:
    """The row's idle gaps in the plan's iteration (``ops``: :class:`launch.plan.timeline.Op`) as windows
    on the rank's wait instructions ``names`` (module docstring). Plan seconds, from the iteration start.
    With the plan's ``transfers`` (:class:`launch.plan.simulate.Transfer`), a window on a receive is the
    receive alone: from the end of the sends before it in the gap to the data's arrival (a gap also
    holds the blocking sends around the receive: stage 0's SendActivation after its RecvGrad, stage 1's
    SendGrad before its RecvActivation; the engine opens the window when the receive starts, so a gap's
    whole length would put the deadline past the receive's end by the sends' time).

    ``step_sync``: the optimizer step waits for every stage (DeepSpeed clips gradients by default, with
    the gradient norm all-reduced over the model-parallel group, which holds the pipeline's stages:
    ``clip_grad_norm_(..., mpu=...)``), so the row's tail is spent in OptimizerStep until the pipeline's
    last row of its replica reached its step (measured, benchmarks.bubbletea: stage 1's OptimizerStep
    13.7-15.3 ms, stage 0's 1.5-3.6 ms, of which cProfile puts 14 ms per iteration in
    ``clip_fp32_gradients`` on stage 1). The tail's window is then OptimizerStep's, to that moment, and
    the rest of the tail the loss broadcast's (AggregateLoss) on every stage but the last: the last
    stage is the broadcast's root and does not wait in it."""
    compute = sorted((op for op in ops if (op.stage, op.replica) == tuple(row) and op.kind in
                      ("forward", "backward")), key=lambda op: op.start)
    positions = [i for i, n in enumerate(names) if n in COMPUTE]
    planned, ran = [op.kind for op in compute], [COMPUTE[names[i]] for i in positions]
    if planned != ran:
        raise ValueError(f"plan_windows: row {tuple(row)}'s plan runs {_short(planned)} but the rank's "
                         f"schedule runs {_short(ran)}: not the same pipeline schedule")
    moved = _transfer_times(transfers, row, names)
    sync = _step_sync(ops, row[1]) if step_sync and "OptimizerStep" in names else None
    out = []
    bounds = [-1, *positions, len(names)]
    edges = [0.0] + [op.end for op in compute]
    for k in range(len(bounds) - 1):
        waits = [i for i in range(bounds[k] + 1, bounds[k + 1]) if names[i] in WAITS]
        if not waits:
            continue
        start = edges[k]
        end = compute[k].start if k < len(compute) else _tail_end(ops, row, iteration, start)
        receives = [i for i in waits if names[i].startswith("Recv")]
        tag = receives[-1] if receives else waits[-1]
        if sync is not None and k == len(compute):      # the tail: OptimizerStep, then AggregateLoss
            out += _step_windows(names, bounds[k], start, end, sync, moved, lane, row[0] == _last(ops))
            continue
        if tag in moved:                # the receive alone: after the sends before it, to its data's arrival
            start = max([start, *(moved[i] for i in waits if i < tag and i in moved)])
            end = min(end, moved[tag])
        if end <= start:
            continue
        out.append(Window(lane, start, end, tag))
    return out


def _transfer_times(transfers: Sequence, row: tuple[int, int], names: Sequence[str]) -> dict[int, float]:
    """Instruction index -> when it returns, for the row's p2p instructions the plan's ``transfers``
    carry: a send when its last byte left (``done``), a receive when the data arrived. The k-th
    instruction of a kind moves micro-batch k (DeepSpeed sends and receives in micro-batch order)."""
    stage, d = row
    by_key = {(t.edge, t.fwd, t.m, t.d): t for t in transfers}
    # instruction -> (boundary, forward, is a receive)
    kinds = {"SendActivation": (stage, True, False), "RecvActivation": (stage - 1, True, True),
             "SendGrad": (stage - 1, False, False), "RecvGrad": (stage, False, True)}
    seen: dict[str, int] = {}
    out = {}
    for i, name in enumerate(names):
        if name not in kinds:
            continue
        m = seen[name] = seen.get(name, -1) + 1
        edge, fwd, receive = kinds[name]
        t = by_key.get((edge, fwd, m, d))
        if t is not None:
            out[i] = t.arrives if receive else t.done
    return out


def _step_sync(ops, replica: int) -> float:
    """When the last row of the pipeline of ``replica`` reaches its optimizer step: its last compute's
    end, or its DP all-reduce's end where it has one (ReduceGrads comes first)."""
    return max(op.end for op in ops if op.replica == replica and op.kind in ("forward", "backward",
                                                                              "allreduce"))


def _last(ops) -> int:
    return max(op.stage for op in ops)


def _step_windows(names, after: int, start: float, end: float, sync: float, moved: dict, lane,
                  last_stage: bool) -> list[Window]:
    """The tail's windows under ``step_sync`` (:func:`plan_windows`): from ``start`` (after the tail's
    sends) on OptimizerStep until ``sync``, then on AggregateLoss until ``end`` (not on the last stage)."""
    opt, agg = names.index("OptimizerStep", after + 1), len(names) - 1
    start = max([start, *(t for i, t in moved.items() if after < i < opt)])
    out = [Window(lane, start, sync, opt)] if sync > start else []
    if not last_stage and names[agg] == "AggregateLoss" and end > max(start, sync):
        out.append(Window(lane, max(start, sync), end, agg))
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
