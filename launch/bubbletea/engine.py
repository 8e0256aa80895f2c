"""BubbleTea on DeepSpeed's pipeline engine: prefill in the bubbles of ``TrainSchedule``.

    engine, *_ = deepspeed.initialize(model=pipeline_module, ...)
    server = PrefillServer(CausalLM(LMConfig(...)), chunk_tokens=64, callback=ship_kv)
    bt = bubbletea.enable(engine, server)      # engine is now a BubbleTeaPipelineEngine
    server.submit("req-1", prompt_ids)         # any time, any thread
    loss = engine.train_batch(data_iter)       # unchanged; prefill runs in its bubbles
    bt.undo()

**Where the bubbles are on a rank.** DeepSpeed's pipeline p2p is blocking (``dist.send``/``dist.recv``;
on gloo even a send waits until the peer has posted its receive), so every bubble of a stage — the
1F1B warm-up and cool-down, the wait on a WAN transfer, the wait on a slower neighbour — is time the
rank's thread spends blocked inside a SendActivation, RecvActivation, SendGrad or RecvGrad
instruction, or in the loss broadcast at the end of ``train_batch``. :class:`BubbleTeaPipelineEngine`
times every instruction of every ``train_batch`` (the real-run timeline, lane = global rank); a wait
instruction's window is its measured length at its place in the schedule (the lower quartile over the
last iterations run without prefill, so prefill never feeds back into its own windows).

**How a window is filled.** Each iteration, :meth:`PrefillServer.plan` packs the queued prompts into
the windows (earliest fit, guard band). At a wait instruction with chunks planned, the training thread
hands them to the rank's prefill thread (deadline = now + the window's length) and then enters the
blocking transfer as usual; the prefill thread runs the chunks while the transfer waits, starting each
only if it ends a guard band before the deadline and the transfer is still pending. The transfer is
posted at once, not after the prefill: a peer blocked in its send on our receive is never held up,
and a transfer that arrives early closes the window at once. The prefill thread runs at nice 19, the
CPU's version of a low-priority stream: on an oversubscribed CPU (4 ranks on 2 cores here), a training
thread that becomes runnable takes the core from any rank's prefill. Training ops are never moved or
changed: the engine runs DeepSpeed's own schedule and instructions.

**One model per rank, not one inference stage per training stage.** The paper's design card suggests
splitting the inference model into a pipeline over the training stages (atlas.md §1.8 step 2). We keep
a whole small model resident on every rank instead: (1) a prefill chunk then needs a window on one
rank only, while a pipelined chunk needs a chain of windows, stage s+1's starting one hop after
stage s's ends; the 1F1B bubbles of adjacent stages are mostly disjoint in time (stage s+1 idles while
stage s works), so chains waste most windows; (2) no inference activations cross stage boundaries, and
so never the WAN; (3) a request's KV cache is complete on one rank, ready to hand off. The price is
memory: a full copy of the weights per GPU, which is why this is for a small model (the simulator's
default is 1.3B parameters, 2.6 GB in bf16, next to an 80 GB GPU's training state).

Exactness: the prefill runs in its own model, under ``inference_mode``, with its own RNG (none at
all: greedy first token), on its own thread; training's weights, gradients, RNG state and
instruction sequence are untouched, so training losses are bit-equal with and without BubbleTea (the
4-rank test checks it).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from deepspeed.runtime.pipe.engine import PipelineEngine

from launch.bubbletea.server import PrefillServer, Worker
from launch.bubbletea.timeline import Op, Window, busy_time

WAITS = frozenset({"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "AggregateLoss"})


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
    nice: int = 19                    # the prefill thread's CPU priority (19: the lowest)
    iterations: list[Iteration] = field(default_factory=list)
    _profile: deque = field(default_factory=deque, init=False)
    _t0: float | None = field(default=None, init=False)
    _ops: list = field(default_factory=list, init=False)
    _plan: dict = field(default_factory=dict, init=False)
    _on: bool = field(default=False, init=False)
    _open: bool = field(default=False, init=False)
    _worker: Worker | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.lane = self.engine.global_rank
        self._profile = deque(maxlen=self.history)
        self._worker = Worker(self.server, self.nice)

    # -- per iteration ------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        n = len(self.iterations)
        reprofile = self.reprofile_every > 0 and (n - self.warmup + 1) % self.reprofile_every == 0
        self._on = self.enabled and n >= self.warmup and len(self._profile) > 0 and not reprofile
        self._plan = {}
        if self._on:
            for window, placed in self.server.plan(self.windows()).by_window().items():
                self._plan[window.tag] = ([p.chunk for p in placed], window.length)
        self._ops, self._t0 = [], time.perf_counter()

    def end_iteration(self, failed: bool = False) -> None:
        t1 = time.perf_counter()
        self._worker.close()
        t0, self._t0 = self._t0, None
        spans = [(max(a, t0) - t0, min(b, t1) - t0) for a, b in self.server.stats.spans if b > t0 and a < t1]
        it = Iteration(t1 - t0, self._ops, spans, self._on)
        self.iterations.append(it)
        if not self._on and not failed:
            self._profile.append(it)
        if self._worker.error is not None and not failed:
            err, self._worker.error = self._worker.error, None
            raise RuntimeError("BubbleTea: the prefill thread failed") from err

    @contextmanager
    def instruction(self, kind: str):
        """Time one instruction; around a wait instruction with planned chunks, open the window."""
        if self._t0 is None:                    # eval_batch, or outside train_batch: not traced
            yield
            return
        tag = len(self._ops)
        planned = self._plan.get(tag) if kind in WAITS else None
        start = time.perf_counter()
        if planned:
            self._worker.open(planned[0], start + planned[1])
        try:
            yield
        finally:
            end = time.perf_counter()
            if planned:
                self._worker.close()
            self._ops.append(Op(self.lane, kind, start - self._t0, end - self._t0))

    def windows(self) -> list[Window]:
        """This rank's windows, from the recent prefill-off iterations: for every wait instruction (by
        its place in the schedule) the median start and the lower-quartile length."""
        its = [it for it in self._profile if len(it.ops) == len(self._profile[-1].ops)]
        if not its:
            return []
        smallest = self.server.cost(_smallest_chunk(self.server)) + self.server.guard
        floor = smallest if self.min_window is None else self.min_window
        out = []
        for tag, op in enumerate(its[-1].ops):
            if op.kind not in WAITS:
                continue
            starts = [it.ops[tag].start for it in its]
            lengths = sorted(it.ops[tag].end - it.ops[tag].start for it in its)
            length = lengths[(len(lengths) - 1) // 4]
            if length >= floor:
                start = statistics.median(starts)
                out.append(Window(self.lane, start, start + length, tag))
        return out

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait for a chunk still running after the last window closed (before reading statistics)."""
        self._worker.idle(timeout)

    def undo(self) -> None:
        """Stop the prefill thread and give the engine back its DeepSpeed class."""
        self._worker.stop()
        if isinstance(self.engine, BubbleTeaPipelineEngine):
            self.engine.__class__ = PipelineEngine
        self.engine.__dict__.pop("_bubbletea", None)


def _smallest_chunk(server: PrefillServer):
    from launch.bubbletea.packer import Chunk

    c = min(server.chunk_tokens, server.model.cfg.max_seq)
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


def enable(engine: PipelineEngine, server: PrefillServer, **options) -> BubbleTea:
    """Switch BubbleTea on for a DeepSpeed pipeline engine; ``options`` go to :class:`BubbleTea`.
    Returns the controller (``.undo()``, ``.enabled``, ``.iterations``)."""
    for name, least in (("history", 1), ("warmup", 0), ("reprofile_every", 0)):
        v = options.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            raise ValueError(f"bubbletea.enable: {name}={v!r} must be an integer >= {least}")
    if type(engine) is not PipelineEngine:
        raise TypeError(f"bubbletea.enable: engine must be a deepspeed PipelineEngine (what "
                        f"deepspeed.initialize returns for a PipelineModule), got {type(engine).__name__}")
    server.calibrate()
    bt = BubbleTea(engine, server, **options)
    engine._bubbletea = bt
    engine.__class__ = BubbleTeaPipelineEngine
    return bt
