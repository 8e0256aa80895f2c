"""Where the prefill runs: a device, a low-priority stream on it, the memory it may take.

Two runners drive the same scheduling code (:class:`launch.bubbletea.service.Service`):

- on a CPU rank, a separate process at ``SCHED_IDLE`` priority (:mod:`.service`'s ``main``): the CPU's
  scheduler is the only arbiter there is between training and prefill, and SCHED_IDLE is its
  "lowest priority stream";
- on an accelerator, :class:`StreamRunner`: a thread of the rank's own process that issues the chunks'
  kernels on a stream of the least priority of the device (``torch.cuda.Stream(priority=...)``), with the
  model's weights and the KV caches in the rank's memory, capped (:func:`memory_cap`). The README's
  BubbleTea section argues this against a second process on the same GPU (contexts, MPS, memory).

The code names devices by strings and ``torch.device`` only; the one CUDA-specific part, the stream, is
behind :func:`prefill_stream` / :func:`on_stream` / :func:`synchronize`, whose CPU version is the *null
stream* (``None``: ops run at once, in order, on the calling thread). The CPU tests run
:class:`StreamRunner` with the null stream, so the window rule, the memory cap and the hand-off they
check are the code a GPU runs; only the stream object differs.

Priorities: CUDA numbers them from 0 (the least, and the default stream's) down to
``torch.cuda.Stream.priority_range()``'s greatest (-5 on recent GPUs; lower is more urgent). A
prefill stream therefore cannot rank *below* a training that runs on the default stream, only equal;
:func:`training_stream` gives training a stream of the greatest priority for the block scheduler to
prefer (the GPU never preempts a running block for it: what keeps a chunk out of the training's way at
the end of a window is the guard band, the priority only decides whose blocks start first when both
wait).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import traceback
from collections.abc import Callable

import torch


def as_device(device) -> torch.device:
    """A ``torch.device`` from a string, an index (the current accelerator's) or a device; None: cpu."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        acc = torch.accelerator.current_accelerator()
        if acc is None:
            raise ValueError(f"device={device}: an index needs an accelerator, and this torch sees none")
        return torch.device(acc.type, device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: not a device ({e})") from None


def prefill_stream(device: torch.device):
    """The stream prefill runs on: the least priority CUDA offers; None (the null stream) elsewhere."""
    if device.type != "cuda":
        return None
    least, _greatest = _priority_range()
    return torch.cuda.Stream(device=device, priority=least)


def training_stream(device: torch.device):
    """A stream of the greatest priority for the training step (None off CUDA: nothing to prefer)."""
    if device.type != "cuda":
        return None
    _least, greatest = _priority_range()
    return torch.cuda.Stream(device=device, priority=greatest)


def _priority_range() -> tuple[int, int]:
    rng = getattr(torch.cuda.Stream, "priority_range", None)
    return rng() if rng is not None else (0, -1)          # torch < 2.1: its documented pair


@contextlib.contextmanager
def on_stream(stream):
    """Issue the enclosed ops on ``stream`` (the null stream: as they are)."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def synchronize(stream) -> None:
    """Wait until ``stream``'s work is done (a chunk's end is when its kernels end, not when they are
    issued: the window rule and the cost model time that)."""
    if stream is not None:
        stream.synchronize()


def free_memory(device: torch.device) -> int:
    """Bytes the device has free now: the driver's count on CUDA (what the caching allocators of every
    process have not reserved), MemAvailable on a CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        acc = torch.accelerator
        free, _total = acc.get_memory_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def memory_cap(device: torch.device, fraction: float, sharers: int = 1) -> tuple[int, int]:
    """(free bytes, cap = fraction · free / sharers): measured after training's first iterations, when
    its allocator has reserved what the step needs; ``sharers``: the ranks whose services draw on the
    same free memory (a host's local ranks on CPU), each capped at its share."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory_fraction={fraction}: must lie in (0, 1]")
    if isinstance(sharers, bool) or not isinstance(sharers, int) or sharers < 1:
        raise ValueError(f"sharers={sharers!r}: must be a positive integer (ranks sharing the memory)")
    free = free_memory(device)
    return free, int(fraction * free / sharers)


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in module.parameters()) + sum(t.nbytes for t in module.buffers())


class StreamRunner:
    """The in-process runner: one thread, an inbox of the service protocol's messages, the service's
    work issued on the prefill stream. ``emit`` receives its out-messages (on this thread).

    The thread waits in ``queue.get`` (no GIL held) between messages and in ``synchronize`` at the end of
    every chunk; between them it holds the GIL only to issue kernels, each op's dispatch releasing it.
    """

    def __init__(self, make_service: Callable, device: torch.device, emit: Callable) -> None:
        self.device, self.emit = device, emit
        self.stream = prefill_stream(device)
        self.inbox: queue.Queue = queue.Queue()
        self._make = make_service
        self.thread = threading.Thread(target=self._run, name="bubbletea-prefill", daemon=True)
        self.thread.start()

    def post(self, *msg) -> None:
        self.inbox.put(msg)

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with on_stream(self.stream):
                service = self._make(self.stream, self.inbox.put)
                self.emit("ready", service.fit, service.address)
                while service.handle(self.inbox.get()):
                    pass
        except BaseException:
            self.emit("error", traceback.format_exc())

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self.post("stop")
        self.thread.join(timeout)
