"""A local world of N ranks on one machine, started once and reused for many calls.

Tests and benchmarks run code on every rank with ``world.run(fn, *args)``: ``fn`` is a module-level
function (it travels by reference to the spawned ranks), runs with ``torch.distributed`` already
initialised (gloo by default), and its per-rank return values come back as a list.

Failure handling is what keeps CI from hanging:
- a rank that raises sends its traceback; the first one is re-raised here as :class:`RankError`
  (other ranks are given a moment to report theirs, which are appended);
- a rank that dies (segfault, ``os._exit``) is seen through its process sentinel;
- a call that outlives ``timeout`` seconds raises :class:`WorldTimeout` naming the ranks still busy;
and in all three cases every rank is killed and the world restarts on the next ``run``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait

from commweave import values

_SPAWN = mp.get_context("spawn")
_FORKSERVER = mp.get_context("forkserver")


class RankError(RuntimeError):
    """A function raised on one or more ranks; the message holds each rank's traceback."""


class WorldTimeout(TimeoutError):
    """A call did not finish on every rank in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, env: dict, conn, pg_timeout: float) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get("COMMWEAVE_RANK_THREADS", "1")))
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        conn.send(("ready", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


def _remove_deepspeed_shm(port: int, ranks: int) -> None:
    """DeepSpeed's CPU all-reduce (``deepspeed/ops/csrc/cpu/comm/shm.cpp``) gives every rank a 67 MB
    /dev/shm buffer named after the master address and port, and never unlinks it: with a new port for
    every world, RAM fills up. The ranks are gone by now, so their buffers can go too."""
    for rank in range(ranks):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}")


@dataclass
class World:
    """N spawned ranks with an initialised process group, reused across calls.

    ``env`` is added to each rank's environment before the rank imports torch, unless preloaded
    (``DS_ACCELERATOR`` defaults to ``cpu``; ``COMMWEAVE_RANK_THREADS`` sets torch's intra-op threads per
    rank, 1 by default so that N ranks do not oversubscribe a small machine).

    ``preload`` names modules that a fork server imports once; the ranks then fork from it instead of
    starting fresh interpreters, so torch's, DeepSpeed's and megatron-core's imports (2, 4 and 8 s on this
    project's 2-core machine, measured together with their predecessors, load 0.8) are paid once per
    process, not once per rank of every world.
    The fork server is the process's one (``multiprocessing``'s ``forkserver``): the first world with a
    preload starts it with this process's environment and that world's list, which then hold for every
    later world. A preloaded module has read its environment variables there, before ``env`` reaches the
    rank, so ``env`` may not change ``DS_ACCELERATOR`` (DeepSpeed picks its accelerator at import).
    """

    world_size: int
    backend: str = "gloo"
    env: dict = field(default_factory=dict)
    timeout: float = 180.0
    start_timeout: float = 120.0
    preload: tuple[str, ...] = ()
    _procs: list = field(default_factory=list, init=False, repr=False)
    _conns: list = field(default_factory=list, init=False, repr=False)
    _port: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        values.integer(self.world_size, "world_size", lo=1, hi=4096, unit="ranks on this machine")
        # the bounds of every wait here, and the process group's own timeout, in commweave's one range
        # (1 s .. 1 week): under 1 ms torch's process group would read it as no timeout at all
        self.timeout = values.seconds(self.timeout, "World.timeout")
        self.start_timeout = values.seconds(self.start_timeout, "World.start_timeout")
        self.preload = tuple(self.preload)
        if self.preload and "DS_ACCELERATOR" in self.env:
            raise ValueError(f"World(env): DS_ACCELERATOR={self.env['DS_ACCELERATOR']!r} with preload="
                             f"{list(self.preload)}: a preloaded DeepSpeed chose its accelerator in the fork "
                             "server already; start this world without a preload")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        self.close()
        port = self._port = free_port()
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **self.env}
        env = {k: str(v) for k, v in env.items()}
        ctx = _SPAWN
        if self.preload:
            ctx = _FORKSERVER
            ctx.set_forkserver_preload(list(self.preload))
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, daemon=True,
                             args=(r, self.world_size, port, self.backend, env, child, self.timeout))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect("start-up", self.start_timeout)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive:
            self.start()
        for c in self._conns:
            c.send((fn, args, kwargs))
        bound = self.timeout if timeout is None else values.seconds(timeout, "World.run(timeout)")
        return self._collect(getattr(fn, "__qualname__", repr(fn)), bound)

    def _collect(self, what: str, timeout: float) -> list:
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error = float("inf")
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            if errors:
                # Give the other ranks a moment to report: their errors often explain the first one.
                deadline = min(deadline, first_error + 1.0)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = wait(list(pending.values()) + [s for s, r in sentinels.items() if r in pending], left)
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    if r in pending and not pending[r].poll():
                        self._procs[r].join()
                        errors[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                        first_error = min(first_error, time.monotonic())
                        pending.pop(r)
                    continue
                r = next(i for i, c in pending.items() if c is obj)
                try:
                    status, value = obj.recv()
                except EOFError:
                    self._procs[r].join(timeout=1.0)
                    errors[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                    first_error = min(first_error, time.monotonic())
                    pending.pop(r)
                    continue
                pending.pop(r)
                if status == "err":
                    errors[r] = value
                    first_error = min(first_error, time.monotonic())
                else:
                    results[r] = value
        if errors or pending:
            self.close(force=True)
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if not errors:
                raise WorldTimeout(f"{what}: ranks {sorted(pending)} of {self.world_size} did not finish "
                                   f"within {timeout:.0f} s; all ranks killed")
            if pending:
                parts.append(f"(ranks {sorted(pending)} still busy; all ranks killed)")
            raise RankError(f"{what} failed on rank(s) {sorted(errors)}:\n" + "\n".join(parts))
        return [results[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop every rank: politely when idle, by SIGKILL when ``force`` or after a short grace."""
        for c, p in zip(self._conns, self._procs, strict=True):
            if p.is_alive() and not force:
                with contextlib.suppress(BrokenPipeError, OSError):
                    c.send(None)
        deadline = time.monotonic() + (0.0 if force else 5.0)
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()
        if self._procs:
            _remove_deepspeed_shm(self._port, len(self._procs))
        self._procs.clear()
        self._conns.clear()

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
