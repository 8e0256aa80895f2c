"""The prefill process of one rank: ``main([fd_in, fd_out, fd_window])`` in a fresh interpreter.

Started by :class:`launch.bubbletea.server.PrefillServer`; it owns the request queue, the resident
inference model, the chunk cost model and the packer, and runs at the lowest CPU priority, the CPU
stand-in for a low-priority CUDA stream: Linux's ``SCHED_IDLE`` policy (a normal thread that wakes up
preempts it at once; under nice 19 alone the scheduler may first let it finish its time slice, which
delays the training thread by up to a slice at every transfer it waits for) and nice 19. Why a process
and not a thread of the rank: a prefill thread would share the rank's GIL, and a low-priority thread
descheduled while it holds the GIL stalls the training thread exactly when its transfer completes (the
moment the other ranks compute and the cores are busy). Here the two share nothing but a window word in
shared memory.

Messages in (pickled, over a pipe), one per line of the protocol:
    ("setup", dict)                      config, weights, chunk size, guard, nice, idle, threads, cost, cpus
    ("submit", id, tokens, t_submit)     queue a prompt
    ("windows", [(tag, start, length)])  pack the queue into the coming iteration's windows
    ("open", tag, seq)                   a window opened: run its chunks while the window word allows
    ("drain",)                           prefill everything queued, now
    ("ping", n)                          reply ("pong", n) once everything before it is done
    ("stop",)
Messages out: ("ready", fit), ("chunk", t0, t1, tokens, ratio), ("skipped", n, "closed" | "short"),
("done", id, k, v, length, logits, first_token, t_submit, t_done), ("pong", n), ("error", traceback).

The window word is two float64: (seq, deadline). The rank writes the deadline then the seq when a
window opens, and the deadline 0 when it closes; a chunk starts only if the seq is the open message's
and ``now + predicted cost + guard <= deadline`` (perf_counter is one monotonic clock for every process).
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
import traceback
from collections import OrderedDict
from multiprocessing.connection import Connection

import torch

from launch.bubbletea.model import CausalLM, KVCache, LMConfig
from launch.bubbletea.packer import Chunk, Request, pack
from launch.bubbletea.timeline import Window


def send(conn: Connection, *msg) -> None:
    """Standard pickle: tensors travel by value (no fd passing between unrelated processes)."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def fit_cost(model: CausalLM, chunk_tokens: int, repeats: int = 3) -> tuple[float, float, float]:
    """Time chunks of two sizes into caches of two capacities; least squares of ``a + b·c + e·c·T``
    (projections and MLP per token, attention against the whole cache; :mod:`.model`)."""
    cfg = model.cfg
    caps = sorted({min(cfg.max_seq, chunk_tokens), min(cfg.max_seq, 4 * chunk_tokens)})
    rows, times = [], []
    g = torch.Generator().manual_seed(0)
    for cap in caps:
        for size in sorted({max(1, min(chunk_tokens, cap) // 2), min(chunk_tokens, cap)}):
            tokens = torch.randint(cfg.vocab, (size,), generator=g)
            samples = []
            for _ in range(repeats + 1):                      # the first run warms the kernels
                cache = KVCache.empty(cfg, cap)
                # at the cache's end: CausalLM attends to the whole capacity wherever a chunk is, a model
                # that attends to the filled prefix only (hf.HFModel) shows its c·T term only there
                cache.length = cap - size
                t0 = time.perf_counter()
                model.prefill_chunk(tokens, cache)
                samples.append(time.perf_counter() - t0)
            rows.append([1.0, float(size), float(size * cap)])
            times.append(sorted(samples[1:])[len(samples[1:]) // 2])
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                             torch.tensor(times, dtype=torch.float64)[:, None]).solution.flatten()
    a, b, e = (max(0.0, float(x)) for x in sol)
    return (a or 0.1 * min(times), b, e)


class Service:
    def __init__(self, out: Connection, window: memoryview, setup: dict) -> None:
        self.out, self.window = out, window
        self.cfg: LMConfig = setup["config"]
        build = getattr(self.cfg, "build", None)      # a config that loads its own model (hf.HFConfig)
        self.model = build() if build is not None else CausalLM(self.cfg)
        if setup.get("state_dict") is not None:
            self.model.load_state_dict(setup["state_dict"])
        self.chunk_tokens, self.guard = setup["chunk_tokens"], setup["guard"]
        self.fit = setup.get("cost") or fit_cost(self.model, self.chunk_tokens)
        self.ratio = 1.0             # measured / predicted, a running mean
        self.queue: OrderedDict = OrderedDict()     # id -> [tokens, t_submit, cache | None, done]
        self.plan: dict = {}

    def cost(self, chunk: Chunk) -> float:
        a, b, e = self.fit
        return self.ratio * (a + b * chunk.tokens + e * chunk.tokens * chunk.total)

    def handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "submit":
            _, rid, tokens, t_submit = msg
            self.queue[rid] = [tokens, t_submit, None, 0]
        elif kind == "windows":
            self.ratio = 1.0 + 0.8 * (self.ratio - 1.0)     # a slow spell that stopped all prefill fades
            windows = [Window(None, start, start + length, tag) for tag, start, length in msg[1]]
            pending = [Request(rid, len(q[0]), done=q[3]) for rid, q in self.queue.items()]
            packing = pack(windows, pending, self.chunk_tokens, self.cost, self.guard)
            self.plan = {w.tag: [p.chunk for p in ps] for w, ps in packing.by_window().items()}
        elif kind == "open":
            self.run_window(msg[1], msg[2])
        elif kind == "drain":
            for rid in list(self.queue):
                q = self.queue[rid]
                for chunk in Request(rid, len(q[0]), done=q[3]).chunks(self.chunk_tokens):
                    self.run_chunk(chunk)
        elif kind == "ping":
            send(self.out, "pong", msg[1])
        elif kind == "stop":
            return False
        return True

    def run_window(self, tag, seq: float) -> None:
        chunks = self.plan.pop(tag, [])
        for i, chunk in enumerate(chunks):
            if self.window[0] != seq or self.window[1] == 0.0:
                send(self.out, "skipped", len(chunks) - i, "closed")
                return
            if time.perf_counter() + self.cost(chunk) + self.guard > self.window[1]:
                send(self.out, "skipped", len(chunks) - i, "short")
                return
            self.run_chunk(chunk)

    def run_chunk(self, chunk: Chunk) -> None:
        q = self.queue.get(chunk.request)
        if q is None or q[3] != chunk.lo:          # an earlier chunk of it was not run: not its turn
            return
        tokens, t_submit, cache, _ = q
        if cache is None:
            cache = q[2] = KVCache.empty(self.cfg, len(tokens))
        predicted = self.cost(chunk)
        t0 = time.perf_counter()
        logits = self.model.prefill_chunk(tokens[chunk.lo:chunk.hi], cache)
        t1 = time.perf_counter()
        q[3] = chunk.hi
        self.ratio *= 0.8 + 0.2 * (t1 - t0) / predicted
        send(self.out, "chunk", t0, t1, chunk.tokens, self.ratio)
        if chunk.hi == len(tokens):
            del self.queue[chunk.request]
            last = logits[-1]
            send(self.out, "done", chunk.request, cache.k, cache.v, cache.length, last, int(last.argmax()),
                 t_submit, t1)


def main(fds: list[int]) -> None:
    fd_in, fd_out, fd_window = fds
    conn_in, out = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    window = memoryview(mmap.mmap(fd_window, 16)).cast("d")
    parent = os.getppid()
    try:
        setup = recv(conn_in)[1]
        os.setpriority(os.PRIO_PROCESS, 0, setup["nice"])
        if setup["cpus"] is not None:       # before torch starts threads: they inherit mask and policy
            os.sched_setaffinity(0, setup["cpus"])
        if setup["idle"]:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        torch.set_num_threads(setup["threads"])
        service = Service(out, window, setup)
        send(out, "ready", service.fit)
        while True:
            if not conn_in.poll(1.0):
                if os.getppid() != parent:          # the rank died: nothing left to serve
                    return
                continue
            if not service.handle(recv(conn_in)):
                return
    except EOFError:
        return
    except BaseException:
        send(out, "error", traceback.format_exc())
