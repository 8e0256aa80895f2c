"""What one pipeline transfer costs on the WAN, measured by the processes that will send it.

A pipeline's WAN transfer is a burst after an idle gap: one blocking send, answered later. Its cost is
``t = alpha + bytes / rate`` (launch.plan.calibrated.LinkMode), and two sizes give both constants:
64 KiB and 2 MiB sent whole over one connection, 1 and 4 MiB striped over k > 1 connections (both at
or above STRIPE_MIN_BYTES, so both are cut into k stripes as a pipeline's large transfers are).

:func:`pipeline_pingpong` runs the ping-pongs inside a launched job, between each pair of pipeline
peers that crosses the WAN, on the connections the job's sends use (the world group for DeepSpeed's
own p2p, the k-connection WAN groups for ATLAS), at the ranks' own priority and socket settings and
under the machine load of the steps that follow: a constant measured earlier by other processes
(benchmarks.wan.link_constants) tracks the link less well on a shared machine (README, "The simulator
against real runs"). Pairs take turns, so each transfer is alone on the link as the constants assume.
The ranks outside the pair either wait at a barrier or, with :class:`Beside`, run their stage's
compute until the pair is done: in a pipeline step the other replicas compute beside a transfer, and
on a machine with fewer cores than ranks plus the WAN's forwarders that compute takes CPU from the
transfer (measured: the 8-connection 1 MiB cells at load 16, README). Ping-pongs taken beside the
compute measure that contention on the same ranks and cores instead of modelling it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

WHOLE_KIB = (64, 2048)          # one connection: both sizes sent whole
STRIPED_KIB = (1024, 4096)      # k > 1 connections: both sizes striped (>= STRIPE_MIN_BYTES)
REPEATS = 3

Transfer = Callable[[torch.Tensor], None]       # a blocking send or receive to/from the peer


@dataclass(frozen=True)
class Beside:
    """What the ranks outside a pair do during its ping-pongs: ``compute()`` (one unit of their stage's
    work, e.g. a micro-batch's forward and backward) again and again until the pair's first rank says
    it is done, by a one-element message: ``isend(tensor, rank)``/``irecv(tensor, rank)`` return a
    handle with ``wait()`` (commweave.comm.isend/irecv). gloo's receive handle never reports
    completion before ``wait()`` returns, so a thread waits for the message. ``ranks``: the job's."""

    compute: Callable[[], None]
    isend: Callable[[torch.Tensor, int], object]
    irecv: Callable[[torch.Tensor, int], object]
    ranks: Sequence[int]


def sizes_kib(connections: int) -> tuple[int, int]:
    """The two ping-pong sizes for a way of sending over ``connections`` connections."""
    if connections < 1:
        raise ValueError(f"sizes_kib: connections={connections} must be >= 1")
    return STRIPED_KIB if connections > 1 else WHOLE_KIB


def one_way(first: bool, send: Transfer, recv: Transfer, kib: Sequence[int], repeats: int = REPEATS
            ) -> dict[str, dict[str, float]]:
    """Per size in KiB (keys are str), medians of a blocking send answered by a blocking send back:
    ``one_way`` seconds (half the round trip, on the ``first`` side's clock, which spans it whole) and
    ``send_return`` seconds (until the first side's send call returned: a send returns once its last
    bytes are in the kernel's socket buffers, before they arrive). Both sides call it; only the
    first's figures mean anything (NaN on the other). A one-element exchange before each repeat
    starts both sides together."""
    sync = torch.zeros(1)
    out = {"one_way": {}, "send_return": {}}
    for size in kib:
        x, times, sends = torch.ones(size * 256), [], []
        for _ in range(repeats):
            if first:
                send(sync)
                recv(sync)
                t0 = time.monotonic()
                send(x)
                sends.append(time.monotonic() - t0)
                recv(x)
                times.append((time.monotonic() - t0) / 2)
            else:
                recv(sync)
                send(sync)
                recv(x)
                send(x)
        out["one_way"][str(size)] = statistics.median(times) if times else float("nan")
        out["send_return"][str(size)] = statistics.median(sends) if sends else float("nan")
    return out


def fit(seconds: Mapping[str, float], kib: Sequence[int]) -> dict[str, float]:
    """``alpha_s`` and ``Bps`` of t = alpha + bytes / rate through the two sizes' one-way seconds."""
    small, large = kib
    t1, t2 = seconds[str(small)], seconds[str(large)]
    rate = (large - small) * 1024 / max(t2 - t1, 1e-9)
    return {"alpha_s": max(0.0, t1 - small * 1024 / rate), "Bps": rate}


def pipeline_pingpong(pairs: Sequence[tuple[int, int]], me: int, send: Callable[[torch.Tensor, int], None],
                      recv: Callable[[torch.Tensor, int], None], connections: int,
                      barrier: Callable[[], None], repeats: int = REPEATS, beside: Beside | None = None
                      ) -> dict[str, float] | None:
    """Ping-pongs between each WAN pair (sender stage first) in turn. Every rank calls it (``barrier``
    is collective over the job); returns this rank's one-way seconds per size where it is the first
    of a pair, else None. ``send(tensor, peer)``/``recv(tensor, peer)``: the job's way of sending;
    ``beside``: the other ranks compute during each pair's ping-pongs (else they wait at the barrier)."""
    kib, mine = sizes_kib(connections), None
    for a, b in pairs:
        barrier()
        others = [r for r in beside.ranks if r not in (a, b)] if beside is not None else []
        if me in (a, b):
            peer = b if me == a else a
            times = one_way(me == a, lambda t, p=peer: send(t, p), lambda t, p=peer: recv(t, p), kib, repeats)
            mine = times if me == a else mine
            if me == a:
                for w in [beside.isend(torch.ones(1), r) for r in others]:
                    w.wait()
        elif me in others:
            _compute_until(beside, a)
    barrier()
    return mine


def _compute_until(beside: Beside, first: int) -> None:
    """``beside.compute()`` until ``first``'s one-element message arrives (waited for on a thread; an
    error there is raised here)."""
    arrived, failed = threading.Event(), []

    def wait() -> None:
        try:
            beside.irecv(torch.zeros(1), first).wait()
        except Exception as e:     # re-raised on the calling thread
            failed.append(e)
        finally:
            arrived.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    while not arrived.is_set():
        beside.compute()
    waiter.join()
    if failed:
        raise failed[0]


def combine(per_pair: Sequence[Mapping[str, Mapping[str, float]]], connections: int) -> dict:
    """The link mode of a job from its pairs' ping-pongs (:func:`one_way`'s results): per size the
    median over the pairs, then :func:`fit`; the pairs' own figures are kept (``pingpong_s``)."""
    if not per_pair:
        raise ValueError("combine: no pair reported ping-pongs")
    kib = sizes_kib(connections)
    seconds = {str(k): statistics.median(p["one_way"][str(k)] for p in per_pair) for k in kib}
    send_return = {str(k): statistics.median(p["send_return"][str(k)] for p in per_pair) for k in kib}
    return {**fit(seconds, kib), "send_return_s": send_return, "pingpong_s": [dict(p) for p in per_pair]}
