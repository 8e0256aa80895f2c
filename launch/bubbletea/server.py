"""A rank's prefill service, seen from the training process: submit prompts, get KV caches back.

    server = PrefillServer(LMConfig(...), chunk_tokens=64, callback=ship_to_decode)
    server.submit("req-1", prompt_ids)        # any thread
    ...                                        # the engine plans and opens windows (engine.py)
    server.close()

The work runs in a separate process (:mod:`launch.bubbletea.service`, SCHED_IDLE, its own copy of the
weights, its own torch threads); this object is its proxy. The training thread's cost per window is a
store into a shared word and one small pipe message; nothing here holds a lock the prefill needs.

- ``submit(id, tokens)`` queues a prompt. A request is prefilled chunk by chunk into its own KV cache;
  after its last chunk ``callback(PrefillResult)`` receives the cache, the last token's logits and the
  first generated token (greedy: their argmax). The callback runs on this process's collector thread.
- :meth:`plan` hands the coming iteration's windows to the service, which packs its queue into them
  (:func:`launch.bubbletea.packer.pack`, earliest fit, guard band).
- :meth:`open` / :meth:`close` bracket one window: the service starts each planned chunk only while
  the window is open and only if ``now + cost + guard <= deadline``; a chunk it does not start stays
  queued, and so does every later chunk of its request. A started chunk runs to its end
  (non-preemptive, like a GPU kernel; chunks are short next to their windows).

Where the service runs: on the CPUs the rank may use (it inherits the rank's affinity mask), or on
``cpus``. Bind cores to ranks (``deepspeed --bind_cores_to_rank``) so that a rank's bubble is its own
cores idling: a service free to run on every core of a machine shared by several ranks also runs in the
other ranks' compute time, at SCHED_IDLE priority but still a few percent of their step (measured in
``benchmarks.bubbletea``); the server warns when it sees that.

The cost of a chunk of c tokens into a cache of T is ``a + b·c + e·c·T``, fitted when the service starts
and scaled by a running ratio of measured to predicted times, so a busier machine is seen within a few
chunks; the start rule and the packer use the tail of the recent ratios (their 0.9 quantile,
``tail_quantile``), not the mean (:mod:`launch.bubbletea.cost`).
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from launch.bubbletea.cost import check_quantile
from launch.bubbletea.device import StreamRunner, as_device, memory_cap
from launch.bubbletea.model import CausalLM, LMConfig, ModelSpec, Weights
from launch.bubbletea.packer import Chunk
from launch.bubbletea.service import Service, recv, send
from launch.bubbletea.timeline import Window

_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class PrefillResult:
    request: Hashable
    cache: object               # the model's own cache (a KVCache for CausalLM): length, nbytes
    logits: torch.Tensor        # [V], the last prompt token's
    first_token: int
    submitted: float            # time.perf_counter() seconds
    finished: float

    @property
    def ttft(self) -> float:
        """Time to first token: from submit to the end of the prefill."""
        return self.finished - self.submitted


@dataclass
class Stats:
    chunks: int = 0
    tokens: int = 0
    busy: float = 0.0
    skipped: int = 0             # planned chunks not started: the window's rest was too short for them,
    closed: int = 0              # ... or the transfer had returned (the window closed) before their turn
    queue_peak: int = 0
    recalibrated: int = 0
    late: int = 0                # chunks that ended after the end of the window they were started in
    late_s: float = 0.0          # ... by this much in all
    over_tail: int = 0           # chunks that took longer than the start rule's tail cost for them
    ttft: list = field(default_factory=list)
    # the most recent chunks, (t0, t1, tokens, predicted, tail, deadline): how well the cost model predicts
    # (measured t1 - t0 against predicted), and which rule started which chunk (benchmarks.start_rules)
    timings: deque = field(default_factory=lambda: deque(maxlen=10_000))


def _median_p90(xs: list) -> tuple:
    """Median and 90th percentile of sorted ``xs`` (None, None when empty)."""
    return (xs[len(xs) // 2], xs[int(0.9 * (len(xs) - 1))]) if xs else (None, None)


def shared_cores_warning(service_cpus: int, machine_cpus: int, local_ranks: int) -> str | None:
    """The warning for a service that may run on more than its rank's share of the machine's cores."""
    share = max(1, machine_cpus // max(1, local_ranks))
    if local_ranks <= 1 or service_cpus <= share:
        return None
    return (f"BubbleTea: the prefill service may run on {service_cpus} of this machine's {machine_cpus} "
            f"CPUs, which {local_ranks} ranks share ({share} each): it will also run while other ranks "
            "compute and slow their steps. Bind cores to ranks (deepspeed --bind_cores_to_rank) or pass "
            "PrefillServer(cpus=...) so that it uses this rank's idle time only.")


class PrefillServer:
    def __init__(self, config: LMConfig | CausalLM | ModelSpec, chunk_tokens: int,
                 callback: Callable[[PrefillResult], None], guard: float = 1e-3, nice: int = 19,
                 idle: bool = True, threads: int = 1, cost: tuple[float, float, float] | None = None,
                 start_timeout: float = 300.0, cpus: Iterable[int] | None = None, device=None,
                 runner: str | None = None, memory_fraction: float | None = 0.5,
                 pipeline: dict | None = None, tail_quantile: float | None = 0.9) -> None:
        """``config``: the inference model, a :class:`launch.bubbletea.model.ModelSpec` (an
        :class:`LMConfig`, or any picklable spec with ``vocab``, ``max_seq``, ``build(device)``; a
        :class:`CausalLM` sends its weights along); ``device``: where prefill runs (default cpu);
        ``runner``: ``"process"`` (the SCHED_IDLE process, CPU only; the default there) or ``"stream"``
        (a thread of this process on the device's low-priority stream; the default on accelerators);
        ``nice`` and ``idle`` (Linux ``SCHED_IDLE``): the process's CPU priority; ``cost``: a fixed
        ``(a, b, e)`` instead of timing the model; ``cpus``: the CPUs the process may run on (default:
        the rank's); ``memory_fraction``: the KV caches' cap, as a fraction of the device memory free
        after training's first iterations (:meth:`measure_memory`; None: no cap); ``pipeline``: set by
        :func:`launch.bubbletea.pipelined.stage_server` (one stage of a pipelined inference model);
        ``tail_quantile``: a chunk starts only if its cost at this quantile of the recent measured ones
        ends a guard band before its window closes (None: its mean cost; :mod:`launch.bubbletea.cost`)."""
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens!r}: a chunk holds at least one token")
        if not guard >= 0:
            raise ValueError(f"guard={guard}: the guard band cannot be negative")
        if not -20 <= nice <= 19:
            raise ValueError(f"nice={nice}: Linux nice values lie in -20..19")
        check_quantile(tail_quantile)
        if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction={memory_fraction!r}: must lie in (0, 1], or be None (no cap)")
        self.device = as_device(device)
        runner = runner or ("process" if self.device.type == "cpu" else "stream")
        if runner not in ("process", "stream") or (runner == "process" and self.device.type != "cpu"):
            raise ValueError(f"runner={runner!r}: 'stream' (any device) or 'process' (device cpu only; "
                             f"device here is {self.device})")
        if isinstance(config, CausalLM):
            spec = Weights(config.cfg, {k: v.cpu() for k, v in config.state_dict().items()})
        elif isinstance(config, ModelSpec):
            spec = config
        else:
            raise ValueError(f"config={type(config).__name__}: an LMConfig, a CausalLM or a ModelSpec "
                             "(vocab, max_seq, build(device))")
        allowed = os.sched_getaffinity(0)
        if cpus is not None:
            given = [cpus] if isinstance(cpus, (str, bytes, int)) else list(cpus)
            if (not given or any(isinstance(c, bool) or not isinstance(c, int) for c in given)
                    or not set(given) <= allowed):
                raise ValueError(f"cpus={cpus!r}: must be a non-empty list of CPU numbers among this rank's "
                                 f"{sorted(allowed)}")
            cpus = sorted(set(given))
        local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"   # launchers' count
        self.local_ranks = max(1, int(local)) if local.isdigit() else 1
        warning = runner == "process" and shared_cores_warning(len(cpus or allowed), os.cpu_count() or 1,
                                                               self.local_ranks)
        if warning:
            warnings.warn(warning, stacklevel=2)
        self.config, self.runner, self.memory_fraction = spec, runner, memory_fraction
        self.chunk_tokens, self.callback, self.guard = chunk_tokens, callback, guard
        self.stats = Stats()
        self.memory: dict = {}
        self.error: str | None = None
        self._ratio = 1.0
        self._lock = threading.Lock()
        self._pending: set = set()
        self._pongs: dict[int, threading.Event] = {}
        self._seq = 0.0
        self._spans: deque = deque(maxlen=100_000)   # (start, end) perf_counter of chunks not yet taken
        self._ready, self._linked = threading.Event(), threading.Event()
        self._first: tuple = ()
        setup = {"model": spec, "device": str(self.device), "chunk_tokens": chunk_tokens, "guard": guard,
                 "nice": nice, "idle": idle, "threads": threads, "cost": cost, "cpus": cpus,
                 "memory_cap": None, "tail_quantile": tail_quantile, **(pipeline or {})}
        if runner == "stream":
            self._proc = None
            self._window = memoryview(array.array("d", [0.0, 0.0]))
            self._runner = StreamRunner(lambda stream, post: Service(self._on, self._window, setup, stream,
                                                                     post), self.device, self._on)
            if not self._ready.wait(start_timeout):
                raise RuntimeError(f"the BubbleTea prefill stream did not start within {start_timeout} s")
            if self._first[0] != "ready":
                raise RuntimeError(f"the BubbleTea prefill stream failed to start:\n{self._first[-1]}")
            self.fit, self.address = self._first[1:3]
            return
        self._runner = None
        fd_window = os.memfd_create("bubbletea-window")
        os.ftruncate(fd_window, 16)
        self._window = memoryview(mmap.mmap(fd_window, 16)).cast("d")
        from_parent, to_child = os.pipe()          # (read end, write end)
        from_child, to_parent = os.pipe()
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        fds = (from_parent, to_parent, fd_window)
        code = f"from launch.bubbletea.service import main; main({list(fds)})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=fds,
                                      env={**os.environ, "PYTHONPATH": path}, cwd=_ROOT)
        for fd in fds:
            os.close(fd)
        self._to = Connection(to_child, readable=False)
        self._from = Connection(from_child, writable=False)
        send(self._to, "setup", setup)
        deadline = time.monotonic() + start_timeout
        while not self._from.poll(0.5):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError("the BubbleTea prefill service did not start "
                                   f"(exit code {self._proc.poll()})")
        msg = recv(self._from)
        if msg[0] != "ready":
            self._proc.kill()
            raise RuntimeError(f"the BubbleTea prefill service failed to start:\n{msg[-1]}")
        self.fit, self.address = msg[1:3]
        self._collector = threading.Thread(target=self._collect, name="bubbletea-collector", daemon=True)
        self._collector.start()

    def _post(self, *msg) -> None:
        """One message to the service (callers hold ``_lock`` where order with other senders matters)."""
        if self._runner is not None:
            self._runner.post(*msg)
        else:
            send(self._to, *msg)

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, request: Hashable, tokens: torch.Tensor) -> None:
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().clone()
        if not 1 <= tokens.numel() <= self.config.max_seq:
            raise ValueError(f"request {request!r}: {tokens.numel()} tokens; the model takes "
                             f"1..{self.config.max_seq}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab:
            raise ValueError(f"request {request!r}: token ids must lie in [0, {self.config.vocab})")
        with self._lock:
            if request in self._pending:
                raise ValueError(f"request {request!r} is already queued")
            self._pending.add(request)
            self.stats.queue_peak = max(self.stats.queue_peak, len(self._pending))
            self._post("submit", request, tokens, time.perf_counter())

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        """Whether the service still runs (:mod:`.endpoint` re-queues a dead one's requests)."""
        return self._runner.alive() if self._runner is not None else self._proc.poll() is None

    def take_spans(self, until: float) -> list[tuple[float, float]]:
        """The (start, end) of the chunks that ended by ``until`` and were not taken before; the service
        runs one chunk at a time, so they arrive in order."""
        out = []
        while self._spans and self._spans[0][1] <= until:
            out.append(self._spans.popleft())
        return out

    def cost(self, chunk: Chunk, calibrated: bool = False) -> float:
        """The service's prediction for a chunk, in seconds: as last measured, or as calibrated at start."""
        a, b, e = self.fit
        return (1.0 if calibrated else self._ratio) * (a + b * chunk.tokens + e * chunk.tokens * chunk.total)

    # -- windows ------------------------------------------------------------------------------------
    def plan(self, windows: Sequence[Window]) -> None:
        with self._lock:
            self._post("windows", [(w.tag, w.start, w.length) for w in windows])

    def open(self, tag, deadline: float) -> None:
        """A window opens now and ends at ``deadline`` (perf_counter seconds)."""
        self._seq += 1
        self._window[1] = deadline
        self._window[0] = self._seq
        with self._lock:
            self._post("open", tag, self._seq)

    def close(self) -> None:
        self._window[1] = 0.0

    def drain(self) -> None:
        """Prefill everything still queued, now (at the end of a run), and wait for it."""
        with self._lock:
            self._post("drain")
        self.sync()

    def sync(self, timeout: float = 120.0) -> None:
        """Return once the service has done everything asked before, and its results are delivered."""
        event = threading.Event()
        with self._lock:
            n = len(self._pongs)
            self._pongs[n] = event
            self._post("ping", n)
        if not event.wait(timeout):
            raise TimeoutError(f"the BubbleTea prefill service did not answer within {timeout} s")
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the BubbleTea prefill service failed:\n{self.error}")

    def link(self, to, timeout: float = 120.0) -> None:
        """Pipelined: ``"accept"`` the previous stage's service, or reach the next one's at address ``to``
        (:func:`launch.bubbletea.pipelined.link_stages` calls both, in an order that cannot deadlock)."""
        self._linked.clear()
        with self._lock:
            self._post("link", to)
        if not self._linked.wait(timeout):
            raise TimeoutError(f"BubbleTea: the pipelined stage's link ({to!r}) did not come up in "
                               f"{timeout} s")
        self.raise_error()

    def measure_memory(self) -> dict:
        """Cap the KV caches at ``memory_fraction`` of the device memory free now, on CPU divided among the
        host's local ranks (``LOCAL_SIZE`` or ``LOCAL_WORLD_SIZE``). Call it after training's first
        iterations (:class:`launch.bubbletea.engine.BubbleTea` does, once its warm-up is over). Returns
        and keeps ``memory``: free, cap, weights, kv, kv_peak (bytes)."""
        if self.memory_fraction is None:
            return self.memory
        # on CPU the host's local ranks share one free memory: each takes its share of the fraction
        free, cap = memory_cap(self.device, self.memory_fraction,
                               self.local_ranks if self.device.type == "cpu" else 1)
        self.memory = {**self.memory, "free": free, "cap": cap}
        with self._lock:
            self._post("cap", cap)
        self.sync()
        return self.memory

    def set_tail_quantile(self, quantile: float | None) -> None:
        """The start rule from the next plan on: ``quantile`` as in the constructor (None: the mean cost).
        The recent chunks' samples are kept, so a rule switched in mid-run prices on the same machine."""
        check_quantile(quantile)
        with self._lock:
            self._post("quantile", quantile)

    def recalibrate(self) -> None:
        """Ask the service to time its model again (a cost model that puts every window out of reach)."""
        with self._lock:
            self._post("recalibrate")

    def counters(self) -> dict:
        """This rank's service in numbers: chunks, tokens, prompts done, queue depth, TTFT, memory."""
        st = self.stats
        ttft = _median_p90(sorted(st.ttft))
        ratio = _median_p90(sorted((t1 - t0) / p for t0, t1, _, p, _, _ in list(st.timings) if p > 0))
        return {"chunks": st.chunks, "tokens": st.tokens, "prompts": len(st.ttft),
                "queue": len(self._pending),
                "queue_peak": st.queue_peak, "busy_s": st.busy, "skipped": st.skipped, "closed": st.closed,
                "late": st.late, "late_s": st.late_s, "over_tail": st.over_tail,
                "ttft_median_s": ttft[0], "ttft_p90_s": ttft[1],
                "cost_ratio_median": ratio[0], "cost_ratio_p90": ratio[1],
                "recalibrated": st.recalibrated, "memory": dict(self.memory)}

    def stop(self) -> None:
        if self._runner is not None:
            self._runner.stop()
            return
        with self._lock:
            if self._proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._post("stop")
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._collector.join(10)
        self._to.close()

    # -- results --------------------------------------------------------------------------------------
    def _collect(self) -> None:
        while True:
            try:
                msg = recv(self._from)
            except (EOFError, OSError):
                return
            self._on(*msg)

    def _on(self, kind: str, *msg) -> None:
        """One message from the service (the collector thread, or the stream runner's thread)."""
        st = self.stats
        if kind == "chunk":
            t0, t1, tokens, self._ratio, predicted, deadline, tail = msg
            st.chunks, st.tokens, st.busy = st.chunks + 1, st.tokens + tokens, st.busy + (t1 - t0)
            st.timings.append((t0, t1, tokens, predicted, tail, deadline))
            st.over_tail += t1 - t0 > tail
            if deadline and t1 > deadline:
                st.late, st.late_s = st.late + 1, st.late_s + (t1 - deadline)
            self._spans.append((t0, t1))
        elif kind == "skipped":
            if msg[1] == "closed":
                st.closed += msg[0]
            else:
                st.skipped += msg[0]
        elif kind == "done":
            rid, cache, logits, first, t_submit, t_done, memory = msg
            self.memory = {**self.memory, **memory}
            with self._lock:
                self._pending.discard(rid)
            result = PrefillResult(rid, cache, logits, first, t_submit, t_done)
            st.ttft.append(result.ttft)
            try:
                self.callback(result)
            except BaseException as e:          # surfaced to the training thread by raise_error
                self.error = f"the callback raised {e!r}"
        elif kind == "arrived":                 # pipelined: queued here by the previous stage, not submit
            with self._lock:
                self._pending.add(msg[0])
                st.queue_peak = max(st.queue_peak, len(self._pending))
        elif kind == "memory":
            self.memory = {**self.memory, **msg[0]}
        elif kind == "fit":
            self.fit, self._ratio = msg[0], 1.0
            st.recalibrated += 1
        elif kind == "linked":
            self._linked.set()
        elif kind == "pong":
            self._pongs[msg[0]].set()
        elif kind in ("ready", "error") and not self._ready.is_set():
            self._first = (kind, *msg)
            self._ready.set()
        elif kind == "error":
            self.error = msg[0]
            for event in (*self._pongs.values(), self._linked):
                event.set()
