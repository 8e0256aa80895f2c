"""The prefill service of one rank: its request queue, the resident model, the chunk cost model, and the
worker that runs planned chunks while a window is open.

- ``submit(id, tokens)`` queues a prompt (any thread). A request is prefilled chunk by chunk into its own
  KV cache; after the last chunk the caller's ``callback(PrefillResult)`` receives the cache, the last
  token's logits and the first generated token (greedy: their argmax), on the worker thread.
- :meth:`PrefillServer.plan` packs the queue into the windows of the coming iteration
  (:func:`launch.bubbletea.packer.pack`, earliest fit with the guard band).
- :class:`Worker` is one thread per rank. The training thread opens a window (its planned chunks and a
  deadline = window start + the window's measured length) just before it blocks in a pipeline
  send/recv, and closes it when the transfer is done. The worker starts a chunk only while the window
  is open and only if ``now + cost + guard <= deadline``; a chunk it does not start stays queued (and
  so does every later chunk of its request). A started chunk runs to its end: chunks are short next
  to the windows they were packed into (non-preemptive, like a GPU kernel).

The cost of a chunk of c tokens into a cache of T is ``a + b·c + e·c·T`` (projections and MLP per
token, attention against the whole cache, :mod:`launch.bubbletea.model`), fitted once by
:meth:`PrefillServer.calibrate` and then scaled by a running ratio of measured to predicted times, so
a slower (busier) machine is seen within a few chunks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from launch.bubbletea.model import CausalLM, KVCache
from launch.bubbletea.packer import Chunk, Packing, Request, pack
from launch.bubbletea.timeline import Window


@dataclass
class PrefillResult:
    request: Hashable
    cache: KVCache
    logits: torch.Tensor        # [V], the last prompt token's
    first_token: int
    submitted: float            # time.perf_counter() seconds
    finished: float

    @property
    def ttft(self) -> float:
        """Time to first token: from submit to the end of the prefill."""
        return self.finished - self.submitted


@dataclass
class _Live:
    tokens: torch.Tensor
    submitted: float
    cache: KVCache | None = None
    done: int = 0


@dataclass
class Stats:
    chunks: int = 0
    tokens: int = 0
    busy: float = 0.0
    spans: list = field(default_factory=list)       # (start, end) perf_counter of every chunk
    skipped: int = 0                                 # planned chunks not started (window short or closed)
    ttft: list = field(default_factory=list)


class PrefillServer:
    def __init__(self, model: CausalLM, chunk_tokens: int, callback: Callable[[PrefillResult], None],
                 guard: float = 1e-3) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: a chunk holds at least one token")
        if guard < 0:
            raise ValueError(f"guard={guard}: the guard band cannot be negative")
        self.model, self.chunk_tokens, self.callback, self.guard = model, chunk_tokens, callback, guard
        self.stats = Stats()
        self._queue: OrderedDict[Hashable, _Live] = OrderedDict()
        self._lock = threading.Lock()
        self._fit: tuple[float, float, float] | None = None
        self._ratio = 1.0

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, request: Hashable, tokens: torch.Tensor) -> None:
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        if tokens.numel() < 1 or tokens.numel() > self.model.cfg.max_seq:
            raise ValueError(f"request {request!r}: {tokens.numel()} tokens; the model takes "
                             f"1..{self.model.cfg.max_seq}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.model.cfg.vocab:
            raise ValueError(f"request {request!r}: token ids must lie in [0, {self.model.cfg.vocab})")
        with self._lock:
            if request in self._queue:
                raise ValueError(f"request {request!r} is already queued")
            self._queue[request] = _Live(tokens, time.perf_counter())

    def pending(self) -> list[Request]:
        with self._lock:
            return [Request(rid, live.tokens.numel(), done=live.done) for rid, live in self._queue.items()]

    def __len__(self) -> int:
        return len(self._queue)

    # -- cost model ---------------------------------------------------------------------------------
    def calibrate(self, capacities: Sequence[int] = (), repeats: int = 3) -> None:
        """Time chunks of a few sizes into caches of a few capacities; fit ``a + b·c + e·c·T``."""
        cfg, c = self.model.cfg, self.chunk_tokens
        caps = list(capacities) or sorted({min(cfg.max_seq, c), min(cfg.max_seq, 4 * c)})
        rows, times = [], []
        g = torch.Generator().manual_seed(0)
        for cap in caps:
            for size in sorted({max(1, min(c, cap) // 2), min(c, cap)}):
                tokens = torch.randint(cfg.vocab, (size,), generator=g)
                samples = []
                for _ in range(repeats + 1):                      # the first run warms the kernels
                    cache = KVCache.empty(cfg, cap)
                    t0 = time.perf_counter()
                    self.model.prefill_chunk(tokens, cache)
                    samples.append(time.perf_counter() - t0)
                rows.append([1.0, float(size), float(size * cap)])
                times.append(sorted(samples[1:])[len(samples[1:]) // 2])
        sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                 torch.tensor(times, dtype=torch.float64)[:, None]).solution.flatten()
        a, b, e = (max(0.0, float(x)) for x in sol)
        self._fit = (a or min(times) * 0.1, b, e)

    def cost(self, chunk: Chunk) -> float:
        if self._fit is None:
            self.calibrate()
        a, b, e = self._fit
        return self._ratio * (a + b * chunk.tokens + e * chunk.tokens * chunk.total)

    # -- planning and running -----------------------------------------------------------------------
    def plan(self, windows: Sequence[Window]) -> Packing:
        return pack(windows, self.pending(), self.chunk_tokens, self.cost, self.guard)

    def run_chunk(self, chunk: Chunk) -> bool:
        """Prefill one chunk now; False (nothing done) unless it is its request's next chunk."""
        with self._lock:
            live = self._queue.get(chunk.request)
        if live is None or live.done != chunk.lo:
            return False
        if live.cache is None:
            live.cache = KVCache.empty(self.model.cfg, live.tokens.numel())
        predicted = self.cost(chunk) if self._fit is not None else None
        t0 = time.perf_counter()
        logits = self.model.prefill_chunk(live.tokens[chunk.lo:chunk.hi], live.cache)
        t1 = time.perf_counter()
        live.done = chunk.hi
        if predicted:
            self._ratio = 0.8 * self._ratio + 0.2 * self._ratio * (t1 - t0) / predicted
        st = self.stats
        st.chunks, st.tokens, st.busy = st.chunks + 1, st.tokens + chunk.tokens, st.busy + (t1 - t0)
        st.spans.append((t0, t1))
        if chunk.hi == live.tokens.numel():
            with self._lock:
                del self._queue[chunk.request]
            last = logits[-1].clone()
            result = PrefillResult(chunk.request, live.cache, last, int(last.argmax()), live.submitted, t1)
            st.ttft.append(result.ttft)
            self.callback(result)
        return True

    def drain(self) -> None:
        """Prefill everything still queued, now (outside any window: at the end of a run)."""
        for req in self.pending():
            for chunk in req.chunks(self.chunk_tokens):
                self.run_chunk(chunk)


class Worker:
    """The thread that runs a rank's planned chunks inside open windows, at the lowest CPU priority
    (nice 19: the CPU stand-in for a low-priority CUDA stream, atlas.md §1.8 step 5), so that when the
    CPU is short, training threads of this and every other rank run first."""

    def __init__(self, server: PrefillServer, nice: int = 19) -> None:
        self.server, self.nice = server, nice
        self._cv = threading.Condition()
        self._job: tuple[list[Chunk], float] | None = None     # (chunks, deadline)
        self._running = False
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="bubbletea-prefill", daemon=True)
        self._thread.start()

    def open(self, chunks: list[Chunk], deadline: float) -> None:
        with self._cv:
            self._job = (list(chunks), deadline)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            if self._job is not None:
                self.server.stats.skipped += len(self._job[0])
            self._job = None

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no chunk is running (the end of an iteration, before statistics are read)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._job is None and not self._running, timeout)

    def stop(self) -> None:
        with self._cv:
            self._stop, self._job = True, None
            self._cv.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        guard = self.server.guard
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._job is not None)
                if self._stop:
                    return
                chunks, deadline = self._job
                if not chunks:
                    self._job = None
                    self._cv.notify_all()
                    continue
                chunk = chunks[0]
                if time.perf_counter() + self.server.cost(chunk) + guard > deadline:
                    self.server.stats.skipped += len(chunks)
                    self._job = None
                    self._cv.notify_all()
                    continue
                self._job = (chunks[1:], deadline)
                self._running = True
            try:
                self.server.run_chunk(chunk)
            except BaseException as e:      # surfaced to the training thread by BubbleTea.end_iteration
                self.error = e
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()
