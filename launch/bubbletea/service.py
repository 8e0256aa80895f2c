"""The prefill service of one rank: :class:`Service`, the scheduling core (request queue, resident
inference model, chunk cost model, packer, window rule, memory cap), and ``main([fd_in, fd_out,
fd_window])``, the CPU runner: the service in a fresh interpreter. (On an accelerator
:class:`launch.bubbletea.device.StreamRunner` drives the same core from a thread of the rank.)

Started by :class:`launch.bubbletea.server.PrefillServer`; the CPU runner runs at the lowest CPU
priority, the CPU stand-in for a low-priority CUDA stream: Linux's ``SCHED_IDLE`` policy (a normal
thread that wakes up preempts it at once; under nice 19 alone the scheduler may first let it finish its
time slice, which delays the training thread by up to a slice at every transfer it waits for) and nice
19. Why a process and not a thread of the rank: a prefill thread would share the rank's GIL, and a
low-priority thread descheduled while it holds the GIL stalls the training thread exactly when its
transfer completes (the moment the other ranks compute and the cores are busy). Here the two share
nothing but a window word in shared memory.

Messages in (pickled, over a pipe), one per line of the protocol:
    ("setup", dict)                      model spec, device, chunk size, guard, nice, idle, threads, cost,
                                         tail quantile, cpus, memory cap
    ("submit", id, tokens, t_submit)     queue a prompt
    ("windows", [(tag, start, length)])  pack the queue into the coming iteration's windows
    ("open", tag, seq)                   a window opened: run its chunks while the window word allows
    ("drain",)                           prefill everything queued, now
    ("cap", bytes | None)                the KV caches' memory cap (measured by the rank)
    ("recalibrate",)                     time the model again (a cost model that starved the rank)
    ("quantile", q | None)               the start rule's tail quantile from now on (None: the mean cost)
    ("ping", n)                          reply ("pong", n) once everything before it is done
    ("rows", [(id, lo, hi, total, x, t_submit), ...])  pipelined, from the previous stage's link: the
                                         outputs of the chunks it ran in one window (or one drain)
    ("finished", id, ...)                pipelined, from the next stage's link: it finished its part of them
    ("stop",)
Messages out: ("ready", fit), ("chunk", t0, t1, tokens, ratio, predicted, deadline, tail) (predicted:
the mean cost, tail: the start rule's, :mod:`.cost`; deadline 0: no window), ("skipped", n, "closed" |
"short"),
("done", id, cache, logits, first_token, t_submit, t_done, memory), ("memory", memory), ("fit", fit),
("pong", n), ("error", traceback), ("arrived", id) (pipelined: a request's first rows came from the
previous stage); memory = {weights, kv, kv_peak, cap} in bytes.

The window word is two float64: (seq, deadline). The rank writes the deadline then the seq when a
window opens, and the deadline 0 when it closes; a chunk starts only if the seq is the open message's
and ``now + tail cost + guard <= deadline`` (the chunk's cost at a high quantile of the recent measured
ones, :mod:`.cost`; perf_counter is one monotonic clock for every process).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import queue
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener

import torch

from launch.bubbletea.cost import CostModel, check_quantile, fit_cost
from launch.bubbletea.device import synchronize, tensor_bytes
from launch.bubbletea.packer import Chunk, Request, pack
from launch.bubbletea.timeline import Window


def send(conn: Connection, *msg) -> None:
    """Pickled, tensors by value (no fd passing between unrelated processes) as their raw bytes
    (:class:`_Pickler`)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    conn.send_bytes(buf.getbuffer())


def recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


class _Pickler(pickle.Pickler):
    """A CPU tensor travels as its bytes (a numpy array), dtype and shape. torch's own pickling stores
    each storage through ``torch.save`` and loads it through ``torch.load``: a finished request's
    message (benchmarks.bubbletea's 512 KB KV cache and its logits) took 0.30-0.60 ms to unpickle and
    0.21-0.32 ms to pickle, this way 0.04 and 0.06-0.10 ms (fastest-median of 200, one core, load 13).
    The rank unpickles on its collector thread, holding the training process's GIL, which the training
    thread needs back when its wait returns."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type == "cpu":
            flat = obj.detach().contiguous().reshape(-1)
            return _tensor, (flat.view(torch.uint8).numpy(), obj.dtype, tuple(obj.shape))
        return NotImplemented


def _tensor(data, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


class Service:
    """The scheduling core, whichever runner drives it: the request queue, the model, the cost model,
    the packer, the window rule and the memory cap. ``emit(*msg)`` sends the out-messages."""

    def __init__(self, emit: Callable, window, setup: dict, stream=None,
                 post: Callable | None = None) -> None:
        self.emit, self.window, self.stream, self.post = emit, window, stream, post
        self.spec = setup["model"]
        self.device = torch.device(setup.get("device") or "cpu")
        self.model = self.spec.build(self.device)
        self.weights = tensor_bytes(self.model) if isinstance(self.model, torch.nn.Module) else 0
        self.chunk_tokens, self.guard = setup["chunk_tokens"], setup["guard"]
        self.costs = CostModel(setup.get("cost") or self.calibrate(), setup.get("tail_quantile", 0.9))
        if setup.get("cost"):     # no timing run warmed the kernels: do it here, not in the first window
            size = min(self.chunk_tokens, self.spec.max_seq)
            x = torch.zeros(size, dtype=torch.long)
            x = self.model.example_input(x) if hasattr(self.model, "example_input") else x
            self.model.prefill_chunk(x, self.model.new_cache(size))
            synchronize(stream)
        self.queue: OrderedDict = OrderedDict()     # id -> [inputs, t_submit, cache | None, done, total]
        self.plan: dict = {}
        self.cap: int | None = setup.get("memory_cap")   # bytes the KV caches may hold (None: no cap)
        self.kv = self.kv_peak = 0
        # pipelined (launch.bubbletea.pipelined): a stage after the first listens for the one before it
        self.key = setup.get("authkey")
        self.listener = Listener((setup["listen"], 0), authkey=self.key) if setup.get("listen") else None
        self.address = self.listener.address if self.listener is not None else None
        self.down: Connection | None = None                  # the next stage's service
        self.up: Connection | None = None                    # the previous stage's
        # requests started here that the next stage has not finished (pipelined back-pressure: a new
        # request is admitted only while fewer than ``ahead`` are in flight downstream)
        self.ahead: set = set()
        self.ahead_max: int | None = setup.get("ahead")        # None: no bound
        # what a window's chunks hand on, sent once when the window's chunks are done (:meth:`flush`)
        self.rows_out: list = []                              # to the next stage
        self.finished_out: list = []                          # to the previous one

    def calibrate(self) -> tuple[float, float, float]:
        return fit_cost(self.model, self.spec.max_seq, self.spec.vocab, self.chunk_tokens, self.stream)

    @property
    def fit(self) -> tuple[float, float, float]:
        return self.costs.fit

    def cost(self, chunk: Chunk) -> float:
        """The start rule's (and the packer's) cost of a chunk: its tail cost (:mod:`.cost`)."""
        return self.costs.tail(chunk)

    def admitted(self) -> list[Request]:
        """The queue as the packer sees it: requests whose cache exists, then, in FIFO order, those
        whose cache still fits the cap (the first that does not stops the admission: no overtaking) and,
        pipelined, while the requests in flight downstream stay under ``ahead``."""
        out, room = [], None if self.cap is None else self.cap - self.kv
        fresh = 0                         # requests admitted here that this stage has not started yet
        for rid, q in self.queue.items():
            if (q[2] is None and self.down is not None and self.ahead_max is not None
                    and len(self.ahead) + fresh >= self.ahead_max):
                break                     # the next stage is behind: admit nothing new until it catches up
            fresh += q[2] is None
            if q[2] is None and room is not None:
                need = _cache_bytes(self.model, len(q[0]))
                if need > room:
                    break
                room -= need
            out.append(Request(rid, len(q[0]), done=q[3]))
        return out

    def handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "submit":
            _, rid, tokens, t_submit = msg
            self.queue[rid] = [tokens, t_submit, None, 0, len(tokens)]
        elif kind == "rows":                         # the previous stage's chunks of one of its windows
            for rid, lo, hi, total, x, t_submit in msg[1]:
                if rid not in self.queue:            # a new request for this stage: the rank counts it
                    self.emit("arrived", rid)
                q = self.queue.setdefault(rid, [Arrived(), t_submit, None, 0, total])
                q[0].add(lo, hi, x)
        elif kind == "link":                         # pipelined: accept the previous stage, reach the next
            if msg[1] == "accept":
                self.up = self.listener.accept()
                threading.Thread(target=_forward, args=(self.up, self.post), daemon=True).start()
            else:
                self.down = Client(msg[1], authkey=self.key)
                threading.Thread(target=_forward, args=(self.down, self.post), daemon=True).start()
            self.emit("linked", msg[1] == "accept")
        elif kind == "windows":
            self.costs.fade()
            windows = [Window(None, start, start + length, tag) for tag, start, length in msg[1]]
            packing = pack(windows, self.admitted(), self.chunk_tokens, self.cost, self.guard)
            self.plan = {w.tag: [p.chunk for p in ps] for w, ps in packing.by_window().items()}
        elif kind == "open":
            self.run_window(msg[1], msg[2])
        elif kind == "drain":
            for rid in list(self.queue):
                q = self.queue[rid]
                for chunk in Request(rid, len(q[0]), done=q[3]).chunks(self.chunk_tokens):
                    self.run_chunk(chunk)
            self.flush()
            if self.down is not None:         # pipelined: the next stage drains once all of it arrived
                send(self.down, *DRAINED)
        elif kind == "cap":
            self.cap = msg[1]
            self.emit("memory", self.memory())
        elif kind == "recalibrate":
            self.costs.refit(self.calibrate())
            self.emit("fit", self.fit)
        elif kind == "finished":                     # the next stage finished its part of these requests
            self.ahead.difference_update(msg[1:])
        elif kind == "quantile":                     # the samples stay: both rules see the same machine
            self.costs.quantile = check_quantile(msg[1])
        elif kind == "ping":
            self.emit("pong", msg[1])
        elif kind == "stop":
            return False
        return True

    def memory(self) -> dict:
        return {"weights": self.weights, "kv": self.kv, "kv_peak": self.kv_peak, "cap": self.cap}

    def run_window(self, tag, seq: float) -> None:
        chunks = self.plan.pop(tag, [])
        for i, chunk in enumerate(chunks):
            if self.window[0] != seq or self.window[1] == 0.0:
                self.emit("skipped", len(chunks) - i, "closed")
                break
            deadline = self.window[1]
            if time.perf_counter() + self.cost(chunk) + self.guard > deadline:
                self.emit("skipped", len(chunks) - i, "short")
                break
            self.run_chunk(chunk, deadline)
        self.flush()

    def flush(self) -> None:
        """Pipelined: hand on what this window's chunks produced, one message per link. Per chunk, the
        rows' message landed at a random time in the next stage's compute (the stages' windows are the
        other's compute): each woke that stage's SCHED_IDLE link and service threads there, about 45 times
        an iteration in benchmarks.bubbletea --pipelined, and ForwardPass + BackwardPass grew 1-2 ms an
        iteration with chunks that computed nothing (--sleeping-chunks) as with chunks that did
        (benchmarks/RESULTS.md).
        The next stage packs its queue once per iteration (its plan), so rows that come at the end of
        the window rather than chunk by chunk are run no later in most windows."""
        if self.rows_out:
            send(self.down, "rows", self.rows_out)
            self.rows_out = []
        if self.finished_out:
            send(self.up, *FINISHED, *self.finished_out)
            self.finished_out = []

    def run_chunk(self, chunk: Chunk, deadline: float = 0.0) -> None:
        """Run one chunk; ``deadline``: the end of the window it was started in (0: none, a drain)."""
        q = self.queue.get(chunk.request)
        if q is None or q[3] != chunk.lo:          # an earlier chunk of it was not run: not its turn
            return
        tokens, t_submit, cache, _, total = q
        if cache is None:
            if self.down is not None:
                self.ahead.add(chunk.request)
            cache = q[2] = self.model.new_cache(total)
            self.kv += cache.nbytes
            self.kv_peak = max(self.kv_peak, self.kv)
        predicted, tail = self.costs.mean(chunk), self.cost(chunk)
        t0 = time.perf_counter()
        logits = self.model.prefill_chunk(tokens[chunk.lo:chunk.hi], cache)
        synchronize(self.stream)
        t1 = time.perf_counter()
        q[3] = chunk.hi
        self.costs.observe(chunk, t1 - t0, t1)
        self.emit("chunk", t0, t1, chunk.tokens, self.costs.ratio, predicted, deadline, tail)
        if self.down is not None:                  # to the next stage, at the window's end (flush)
            self.rows_out.append((chunk.request, chunk.lo, chunk.hi, total, logits, t_submit))
        if chunk.hi == total:
            del self.queue[chunk.request]
            if self.up is not None:                # the previous stage may admit another request
                self.finished_out.append(chunk.request)
            self.kv -= cache.nbytes                    # handed off: the caller's from here
            if self.down is not None:              # a stage's part: its layers' cache, no logits yet
                self.emit("done", chunk.request, cache, None, None, t_submit, t1, self.memory())
                return
            last = logits[-1]
            self.emit("done", chunk.request, cache, last, int(last.argmax()), t_submit, t1, self.memory())


class Arrived:
    """A later stage's inputs of one request: the chunks' activations as they come, by token range."""

    def __init__(self) -> None:
        self.parts: dict[int, tuple[int, object]] = {}
        self.hi = 0

    def add(self, lo: int, hi: int, x) -> None:
        self.parts[lo] = (hi, x)
        while self.hi in self.parts:
            self.hi = self.parts[self.hi][0]

    def __len__(self) -> int:                        # the tokens ready to run (the packer's request)
        return self.hi

    def __getitem__(self, span: slice):
        hi, x = self.parts.pop(span.start)
        if hi != span.stop:
            raise ValueError(f"chunk [{span.start}, {span.stop}) does not match the arrived "
                             f"[{span.start}, {hi})")
        return x


DRAINED = ("drained",)       # on a stage link: the previous stage drained; drain too, after its rows
FINISHED = ("finished",)     # back on a stage link: this stage finished its part of a request


def _forward(conn: Connection, post: Callable) -> None:
    """A stage link's messages into this service's inbox, in the order they were sent: from the previous
    stage its rows (and its drain), from the next stage its finished requests."""
    try:
        while True:
            msg = recv(conn)        # by value: torch's reductions would pass tensors as fds
            post(("drain",) if msg == DRAINED else msg)
    except (EOFError, OSError):
        return


def _cache_bytes(model, tokens: int) -> int:
    """A prompt's cache size, from an empty cache of one token (caches grow linearly in tokens)."""
    return model.new_cache(1).nbytes * tokens


def main(fds: list[int]) -> None:
    fd_in, fd_out, fd_window = fds
    conn_in, out = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    window = memoryview(mmap.mmap(fd_window, 16)).cast("d")
    parent = os.getppid()
    try:
        setup = recv(conn_in)[1]
        # nice, CPU mask and policy are per thread on Linux: set them on every thread there is (importing
        # torch already started one, which stayed at nice 0 under SCHED_OTHER, found in a benchmark's
        # service) before torch starts its pools, which inherit them
        for tid in map(int, os.listdir("/proc/self/task")):
            os.setpriority(os.PRIO_PROCESS, tid, setup["nice"])
            if setup["cpus"] is not None:
                os.sched_setaffinity(tid, setup["cpus"])
            if setup["idle"]:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        torch.set_num_threads(setup["threads"])
        inbox: queue.Queue = queue.Queue()        # the rank's messages and, pipelined, the previous stage's
        service = Service(lambda *msg: send(out, *msg), window, setup, post=inbox.put)
        send(out, "ready", service.fit, service.address)
        threading.Thread(target=_read, args=(conn_in, inbox), daemon=True).start()
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:          # the rank died: nothing left to serve
                    return
                continue
            if msg is None or not service.handle(msg):
                return
    except EOFError:
        return
    except BaseException:
        send(out, "error", traceback.format_exc())


def _read(conn: Connection, inbox: queue.Queue) -> None:
    try:
        while True:
            inbox.put(recv(conn))
    except (EOFError, OSError):
        inbox.put(None)
