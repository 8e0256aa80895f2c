"""Bubble extraction: one iteration's training ops per GPU -> the idle windows between them.

The input is plain data, so any source can feed it: :func:`from_simulation` reads
:mod:`launch.plan.simulate`'s iteration, :class:`launch.bubbletea.engine.BubbleTeaPipelineEngine` records
a real DeepSpeed run. An :class:`Op` is ``(lane, kind, start, end)`` in seconds from the start of the
iteration; a *lane* is one GPU (one rank): ``(stage, replica)`` in simulation, the global rank in a
real run. Training is periodic per iteration (atlas.md §1.8 step 1), so the windows of one iteration
repeat in the next.

A window is a maximal idle interval of a lane inside ``[0, iteration]`` (warm-up and cool-down
bubbles, waits on WAN transfers, waits on the slower stage), at least ``min_window`` long.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Op:
    lane: Hashable
    kind: str           # "F", "B", "allreduce", or a DeepSpeed instruction name
    start: float
    end: float

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(f"Op {self.kind} on lane {self.lane}: end {self.end} is before "
                             f"start {self.start}")


@dataclass(frozen=True, slots=True)
class Window:
    lane: Hashable
    start: float
    end: float
    tag: object = None  # where the window sits in the schedule (a real run: the instruction it waits in)

    @property
    def length(self) -> float:
        return self.end - self.start


def as_ops(rows: Iterable) -> list[Op]:
    """Ops from plain ``(lane, kind, start, end)`` tuples (or Ops)."""
    return [r if isinstance(r, Op) else Op(*r) for r in rows]


def lanes(ops: Iterable[Op]) -> list:
    return sorted({op.lane for op in ops}, key=repr)


def extract_windows(ops: Iterable, iteration: float, min_window: float = 0.0,
                    all_lanes: Iterable | None = None) -> list[Window]:
    """The idle windows of every lane in ``[0, iteration]``, in (lane, start) order.

    ``all_lanes`` adds lanes without any op (idle all iteration). Ops may overlap within a lane (a
    real run's nested timers); their union is what counts as busy.
    """
    ops = as_ops(ops)
    by_lane: dict = defaultdict(list)
    for op in ops:
        if op.start < -_EPS or op.end > iteration + 1e-9 * max(1.0, iteration):
            raise ValueError(f"{op} lies outside the iteration [0, {iteration}]")
        by_lane[op.lane].append(op)
    for lane in all_lanes or ():
        by_lane.setdefault(lane, [])
    out = []
    for lane in sorted(by_lane, key=repr):
        t = 0.0
        for op in sorted(by_lane[lane], key=lambda o: (o.start, o.end)):
            if op.start - t >= max(min_window, _EPS):
                out.append(Window(lane, t, op.start))
            t = max(t, op.end)
        if iteration - t >= max(min_window, _EPS):
            out.append(Window(lane, t, iteration))
    return out


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def utilisation(ops: Iterable, iteration: float, extra: Iterable = (), n_lanes: int | None = None) -> float:
    """(training busy + ``extra`` busy, e.g. prefill) / (lanes × iteration), union per lane."""
    per_lane: dict = defaultdict(list)
    for op in [*as_ops(ops), *as_ops(extra)]:
        per_lane[op.lane].append((op.start, op.end))
    n = n_lanes or len(per_lane)
    return sum(busy_time(v) for v in per_lane.values()) / (n * iteration)


def from_simulation(result) -> list[Op]:
    """The training ops of one simulated iteration (:func:`launch.plan.simulate.simulate` reports every op,
    :class:`launch.plan.timeline.Op`), per (stage, replica) lane: forward and backward as ``F``/``B``, the DP
    all-reduce; WAN sends and receives are not GPU work and stay out."""
    kinds = {"forward": "F", "backward": "B", "allreduce": "allreduce"}
    return [Op((op.stage, op.replica), kinds[op.kind], op.start, op.end) for op in result.ops
            if op.kind in kinds]
