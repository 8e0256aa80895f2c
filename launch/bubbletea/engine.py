"""BubbleTea on DeepSpeed's pipeline engine: prefill in the bubbles of ``TrainSchedule``.

    engine, *_ = deepspeed.initialize(model=pipeline_module, ...)
    server = PrefillServer(LMConfig(...), chunk_tokens=64, callback=ship_kv)   # starts the prefill process
    bt = bubbletea.enable(engine, server)      # engine is now a BubbleTeaPipelineEngine
    server.submit("req-1", prompt_ids)         # any time, any thread
    loss = engine.train_batch(data_iter)       # unchanged; prefill runs in its bubbles
    bt.undo(); server.stop()

**Where the bubbles are on a rank.** DeepSpeed's pipeline p2p is blocking (``dist.send``/``dist.recv``;
on gloo even a send waits until the peer has posted its receive), so every bubble of a stage — the
1F1B warm-up and cool-down, the wait on a WAN transfer, the wait on a slower neighbour — is time the
rank's thread spends blocked inside a SendActivation, RecvActivation, SendGrad or RecvGrad
instruction, in the loss broadcast at the end of ``train_batch``, or, with gradient clipping (DeepSpeed's
default), in OptimizerStep, whose gradient norm is all-reduced over the stages (:func:`step_sync`; the
window there also holds the step's own compute after the all-reduce, where SCHED_IDLE yields the core to
training). :class:`BubbleTeaPipelineEngine`
times every instruction of every ``train_batch`` (the real-run timeline, lane = global rank); a wait
instruction's window is its measured length at its place in the schedule (the lower quartile over the
last iterations run without prefill, so prefill never feeds back into its own windows).

**How a window is filled.** Each iteration the prefill service packs its queue into the windows
(earliest fit, guard band). At a wait instruction that is a window, the training thread opens it
(deadline = now + the window's length: a store to shared memory and one small message) and enters the
blocking transfer as usual; the prefill process runs the window's chunks meanwhile, starting each only
if it ends a guard band before the deadline and the window is still open; the transfer's return closes
the window. Why not prefill in the training thread before it blocks, for the measured bubble: on gloo
a receive that is not posted holds up the peer's send, so prefill in front of a receive delays the
other stage by as much as it prefills; posting the transfer first and prefilling beside it keeps the
peer's timing, and an early arrival closes the window at once. Why a process and not a thread: a
low-priority thread shares the rank's GIL, and one descheduled while it holds the GIL stalls the
training thread just when its transfer returns (see :mod:`.service`). The service runs under Linux's
SCHED_IDLE policy (and nice 19), the CPU's version of a low-priority stream: a training thread that
becomes runnable takes the core from the prefill at once. It inherits the rank's CPU affinity: with
cores bound to ranks (``deepspeed --bind_cores_to_rank``) a rank's bubble is its own cores idling, as a
GPU's is; unbound on a machine with more ranks than cores, a rank's bubble is another rank's compute
time on the same cores, and the prefill there costs that rank a few percent of its step
(:mod:`benchmarks.bubbletea` measures both). Training ops are never moved or changed: the engine runs
DeepSpeed's own schedule and instructions.

**One model per rank, not one inference stage per training stage.** The paper's design card suggests
splitting the inference model into a pipeline over the training stages (atlas.md §1.8 step 2). We keep
a whole small model resident beside every rank instead: (1) a prefill chunk then needs a window on one
rank only, while a pipelined chunk needs a chain of windows, stage s+1's starting one hop after
stage s's ends; the 1F1B bubbles of adjacent stages are mostly disjoint in time (stage s+1 idles while
stage s works), so chains waste most windows; (2) no inference activations cross stage boundaries, and
so never the WAN; (3) a request's KV cache is complete in one place, ready to hand off. The price is
memory: a full copy of the weights per GPU, which is why this is for a small model (the simulator's
default is 1.3B parameters, 2.6 GB in bf16, next to an 80 GB GPU's training state).

Exactness: the prefill runs in another process, on its own copy of the weights, under
``inference_mode``, with no RNG at all (greedy first token); training's weights, gradients, RNG state
and instruction sequence are untouched, so training losses are bit-equal with and without BubbleTea
(the 4-rank test checks it).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from deepspeed.runtime.pipe.engine import PipelineEngine

from launch.bubbletea.packer import Chunk
from launch.bubbletea.server import PrefillServer
from launch.bubbletea.timeline import Op, Window, busy_time
from launch.bubbletea.windows import (
    SOURCES,
    WAITS,
    combine,
    compare,
    engine_plan,
    instruction_names,
    plan_windows,
)

__all__ = ["WAITS", "BubbleTea", "BubbleTeaPipelineEngine", "Iteration", "enable"]


@dataclass
class Iteration:
    """One ``train_batch`` of one rank: instruction spans relative to its start, and its prefill."""

    wall: float
    ops: list[Op]
    prefill: list[tuple[float, float]]
    prefill_on: bool

    @property
    def training_busy(self) -> float:
        return busy_time((op.start, op.end) for op in self.ops if op.kind not in WAITS)

    @property
    def prefill_busy(self) -> float:
        return busy_time(self.prefill)

    @property
    def utilisation(self) -> float:
        spans = [(op.start, op.end) for op in self.ops if op.kind not in WAITS] + self.prefill
        return busy_time(spans) / self.wall


@dataclass
class BubbleTea:
    """The per-rank controller; created by :func:`enable`."""

    engine: PipelineEngine
    server: PrefillServer
    history: int = 5                  # prefill-off iterations the windows are estimated from
    warmup: int = 2                   # first iterations without prefill (to measure the windows)
    reprofile_every: int = 50         # then one prefill-off iteration in this many
    min_window: float | None = None   # default: one chunk's predicted time + the guard band
    enabled: bool = True              # prefill on in the coming iterations (off: trace only)
    keep: int = 1000                  # the most recent iterations kept in ``iterations``
    starve_after: int = 8             # prefill-on iterations with work queued and no chunk: starved
    windows_from: str = "measured"    # "measured", "plan" or "both" (launch.bubbletea.windows)
    plan: list = field(default_factory=list)    # this rank's windows from ATLAS's plan (plan seconds)
    iterations: deque = field(default_factory=deque, init=False)
    count: int = field(default=0, init=False)  # train_batch calls so far
    starved: int = field(default=0, init=False)   # times the service was found starved (and re-timed)
    # wall time of the prefill-on iterations in which work was queued and no chunk ran (starved or not yet)
    dry_s: float = field(default=0.0, init=False)
    dry_iterations: int = field(default=0, init=False)
    _dry: int = field(default=0, init=False)
    _measured: bool = field(default=False, init=False)
    _profile: deque = field(default_factory=deque, init=False)
    _t0: float | None = field(default=None, init=False)
    _ops: list = field(default_factory=list, init=False)
    _windows: dict = field(default_factory=dict, init=False)
    _on: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.lane = self.engine.global_rank
        # with gradient clipping the optimizer step all-reduces the gradient norm over the pipeline's
        # stages, and a stage that finished its backwards first waits there (windows.plan_windows)
        self.waits = WAITS | ({"OptimizerStep"} if step_sync(self.engine) else set())
        self._profile = deque(maxlen=self.history)
        self.iterations = deque(maxlen=self.keep)

    # -- per iteration ------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        n = self.count
        reprofile = self.reprofile_every > 0 and (n - self.warmup + 1) % self.reprofile_every == 0
        have = len(self._profile) > 0 or (self.windows_from != "measured" and bool(self.plan))
        self._on = self.enabled and n >= self.warmup and have and not reprofile
        self._windows = {}
        if self._on and not self._measured:      # training's allocator has reserved its step by now
            self.server.measure_memory()
            self._measured = True
        if self._on:
            windows = self.windows()
            self.server.plan(windows)
            self._windows = {w.tag: w.length for w in windows}
        self._ops, self._t0 = [], time.perf_counter()

    def end_iteration(self, failed: bool = False) -> None:
        t1 = time.perf_counter()
        self.server.close()
        t0, self._t0 = self._t0, None
        spans = [(max(a, t0) - t0, b - t0) for a, b in self.server.take_spans(t1) if b > t0]
        it = Iteration(t1 - t0, self._ops, spans, self._on)
        self.iterations.append(it)
        self.count += 1
        if not self._on and not failed:
            self._profile.append(it)
        if not failed:
            self.server.raise_error()
            self._watch_starvation(it)

    def _watch_starvation(self, it: Iteration) -> None:
        """A service with prompts queued that ran no chunk for ``starve_after`` prefill-on iterations is
        starved. The cause seen (a rank of ``benchmarks.bubbletea`` at load ~19 ran 0 chunks while the
        other ran 426 prompts): the cost model was timed while other jobs held the rank's core, so one
        chunk's predicted time exceeded every window, no chunk was ever planned, and no measured chunk
        could correct the prediction. So: warn, and have the service time its model again."""
        if not it.prefill_on or not len(self.server) or it.prefill:
            self._dry = 0
            return
        self._dry += 1
        self.dry_s, self.dry_iterations = self.dry_s + it.wall, self.dry_iterations + 1
        if self._dry < self.starve_after:
            return
        self._dry = 0
        self.starved += 1
        longest = max((w.length for w in self.windows(floor=0.0)), default=0.0)
        smallest = self.server.cost(_smallest_chunk(self.server), calibrated=True)
        warnings.warn(f"BubbleTea rank {self.lane}: the prefill service is starved: {len(self.server)} "
                      f"prompts queued, no chunk in {self.starve_after} iterations; longest window "
                      f"{longest * 1e3:.2f} ms, smallest chunk predicted {smallest * 1e3:.2f} ms + guard "
                      f"{self.server.guard * 1e3:.2f} ms. Timing the model again.", stacklevel=2)
        self.server.recalibrate()

    @contextmanager
    def instruction(self, kind: str):
        """Time one instruction; around a wait instruction with planned chunks, open the window."""
        if self._t0 is None:                    # eval_batch, or outside train_batch: not traced
            yield
            return
        tag = len(self._ops)
        length = self._windows.get(tag) if kind in self.waits else None
        start = time.perf_counter()
        if length:
            self.server.open(tag, start + length)
        try:
            yield
        finally:
            end = time.perf_counter()
            if length:
                self.server.close()
            self._ops.append(Op(self.lane, kind, start - self._t0, end - self._t0))

    def windows(self, floor: float | None = None) -> list[Window]:
        """The windows prefill is planned into, from ``windows_from``'s source (:mod:`.windows`); those
        shorter than ``floor`` (default: one chunk's calibrated time + guard, or ``min_window``) left
        out."""
        # the floor uses the calibrated cost: the service packs with its current one (a slow spell that
        # stopped all prefill must not also hide every window from the service, or it never recovers)
        if floor is None:
            smallest = self.server.cost(_smallest_chunk(self.server), calibrated=True) + self.server.guard
            floor = smallest if self.min_window is None else self.min_window
        both = combine(self.windows_from, self.plan, self.measured_windows(0.0))
        return [w for w in both if w.length >= floor]

    def window_report(self) -> dict:
        """Which source the windows come from, and the plan against the measurement per window."""
        return {"source": self.windows_from, **compare(self.plan, self.measured_windows(0.0))}

    def measured_windows(self, floor: float) -> list[Window]:
        """From the recent prefill-off iterations: for every wait instruction (by its place in the
        schedule) the median start and the lower-quartile length, if at least ``floor``."""
        its = [it for it in self._profile if len(it.ops) == len(self._profile[-1].ops)]
        if not its:
            return []
        out = []
        for tag, op in enumerate(its[-1].ops):
            if op.kind not in self.waits:
                continue
            starts = [it.ops[tag].start for it in its]
            lengths = sorted(it.ops[tag].end - it.ops[tag].start for it in its)
            length = lengths[(len(lengths) - 1) // 4]
            if length >= floor:
                start = statistics.median(starts)
                out.append(Window(self.lane, start, start + length, tag))
        return out

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait for a chunk still running after the last window closed (before reading statistics)."""
        self.server.sync(timeout)

    def undo(self) -> None:
        """Give the engine back its DeepSpeed class (the server is the caller's: ``server.stop()``)."""
        if isinstance(self.engine, BubbleTeaPipelineEngine):
            self.engine.__class__ = PipelineEngine
        self.engine.__dict__.pop("_bubbletea", None)


def step_sync(engine) -> bool:
    """Whether ``engine``'s optimizer step waits for every pipeline stage: DeepSpeed clips gradients
    (``gradient_clipping``, 1.0 by default) by a norm all-reduced over the model-parallel group."""
    clipping = getattr(engine, "gradient_clipping", None)
    return callable(clipping) and clipping() > 0 and getattr(engine, "num_stages", 1) > 1


def _smallest_chunk(server: PrefillServer) -> Chunk:
    c = min(server.chunk_tokens, server.config.max_seq)
    return Chunk(None, 0, c, c)


def _traced(kind: str, fn):
    def run(self, **kwargs):
        with self._bubbletea.instruction(kind):
            return fn(self, **kwargs)
    run.__name__ = f"{fn.__name__}_traced"
    return run


class BubbleTeaPipelineEngine(PipelineEngine):
    """DeepSpeed's PipelineEngine with every instruction timed and the wait instructions opening
    BubbleTea's windows. Not constructed directly: :func:`enable` turns a built engine into one."""

    _INSTRUCTION_MAP: ClassVar[dict] = {cls: _traced(cls.__name__, fn)
                                        for cls, fn in PipelineEngine._INSTRUCTION_MAP.items()}

    def train_batch(self, data_iter=None):
        bt = self._bubbletea
        bt.begin_iteration()
        try:
            loss = super().train_batch(data_iter)
        except BaseException:
            bt.end_iteration(failed=True)
            raise
        bt.end_iteration()
        return loss

    def _aggregate_total_loss(self):
        with self._bubbletea.instruction("AggregateLoss"):
            return super()._aggregate_total_loss()


def enable(engine: PipelineEngine, server: PrefillServer, plan=None, **options) -> BubbleTea:
    """Switch BubbleTea on for a DeepSpeed pipeline engine; ``options`` go to :class:`BubbleTea`.
    ``plan``: ATLAS's job (a :class:`launch.plan.simulate.Job` or ``Pipeline``: simulated here as
    DeepSpeed's engine runs it, :func:`launch.bubbletea.windows.engine_plan`: this is DeepSpeed's engine)
    or an iteration already
    simulated (:func:`launch.plan.simulate.simulate`'s result: ``ops``, ``iteration``), whose idle gaps
    on this rank's (stage, replica) become its planned windows (with ``windows_from="plan"`` or
    ``"both"``). Returns the controller (``.undo()``, ``.enabled``, ``.iterations``,
    ``.window_report()``)."""
    source = options.get("windows_from", "measured")
    if source not in SOURCES or (source != "measured" and plan is None):
        raise ValueError(f"bubbletea.enable: windows_from={source!r} must be one of {', '.join(SOURCES)}"
                         + ("" if source not in ("plan", "both") else ", and 'plan'/'both' need plan="))
    for name, least in (("history", 1), ("warmup", 0), ("reprofile_every", 0), ("keep", 1),
                        ("starve_after", 1)):
        v = options.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            raise ValueError(f"bubbletea.enable: {name}={v!r} must be an integer >= {least}")
    if type(engine) is not PipelineEngine:
        raise TypeError(f"bubbletea.enable: engine must be a deepspeed PipelineEngine (what "
                        f"deepspeed.initialize returns for a PipelineModule), got {type(engine).__name__}")
    if plan is not None:
        plan = plan if hasattr(plan, "ops") else engine_plan(plan, "deepspeed")
        names = instruction_names(engine.micro_batches, engine.num_stages, engine.stage_id)
        row = (engine.stage_id, engine.grid.get_data_parallel_id())
        options["plan"] = plan_windows(plan.ops, plan.iteration, row, names, lane=engine.global_rank,
                                       transfers=getattr(plan, "transfers", ()), step_sync=step_sync(engine))
    bt = BubbleTea(engine, server, **options)
    engine._bubbletea = bt
    engine.__class__ = BubbleTeaPipelineEngine
    return bt
