"""A discrete-event what-if simulator of one pipeline-parallel iteration across data centers.

What it models (atlas.md §1.5–1.6; the choices are ours where the paper's text was not available):

- D data-parallel replicas of an S-stage pipeline, each stage running its own schedule
  (1F1B or GPipe) over M micro-batches: ``F(s, m)`` takes ``t_f[s]``, ``B(s, m)`` takes ``t_b[s]``.
  F(s, m) needs the activation of micro-batch m from stage s−1, B(s, m) the gradient from s+1.
- Sends are asynchronous: a stage posts its send and goes on computing (Megatron's overlapped p2p;
  on DeepSpeed's blocking p2p the stage would also wait, which only adds to the exposed time).
- Each stage boundary has a link per direction. An intra-DC boundary gives every replica its own
  path (time = latency + bytes/bandwidth). A WAN boundary is one link shared by the D replicas'
  transfers, and each transfer is also capped at ``per_transfer_cap`` bytes/s (connections ×
  window/RTT, mechanism A). Sharing is
  * ``spatial``: fluid processor sharing, each active transfer at min(cap, B/n) (what TCP gives);
  * ``temporal``: one transfer at a time at min(cap, B), in token order (micro-batch, then replica).
    The link waits for the next token's transfer even if a later one is ready (ATLAS §1.5 step 3).
  A transfer's data arrives one latency after its last byte leaves.
- After a replica's last backward on a stage, the stage's DP all-reduce (``allreduce[s]`` seconds)
  runs; the iteration ends when the last all-reduce ends.

The worked example of atlas.md §1.5 (two stages, D = 2, transfers of one time unit) is reproduced
exactly by tests/launch/test_simulate.py, and so is the design note's toy 1F1B/GPipe table.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Link:
    """One stage boundary; each direction is a separate resource with these properties."""

    latency: float
    bandwidth: float                  # bytes/s of the whole link
    shared: bool = False              # a WAN link shared by the D replicas
    per_transfer_cap: float = float("inf")   # bytes/s one transfer can reach (multi-TCP limit)


@dataclass(frozen=True, slots=True)
class Pipeline:
    t_f: Sequence[float]              # forward seconds per micro-batch, per stage
    t_b: Sequence[float]              # backward seconds per micro-batch, per stage
    links: Sequence[Link]             # boundary s -> s+1 (used in both directions), len S−1
    act_bytes: float                  # bytes per micro-batch crossing a boundary, either direction
    micro_batches: int
    replicas: int = 1
    schedule: str = "1f1b"            # "1f1b" | "gpipe"
    sharing: str = "temporal"         # "temporal" | "spatial"
    allreduce: Sequence[float] = ()   # DP all-reduce seconds per stage (0 when absent)

    def __post_init__(self) -> None:
        s = len(self.t_f)
        if s < 1 or len(self.t_b) != s or len(self.links) != s - 1:
            raise ValueError(f"Pipeline: t_f ({len(self.t_f)}), t_b ({len(self.t_b)}) and links "
                             f"({len(self.links)}) must describe S stages and S−1 boundaries")
        if self.micro_batches < 1 or self.replicas < 1:
            raise ValueError(f"Pipeline: micro_batches={self.micro_batches} and replicas={self.replicas} "
                             "must be >= 1")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"Pipeline.schedule={self.schedule!r}: use '1f1b' or 'gpipe'")
        if self.sharing not in ("temporal", "spatial"):
            raise ValueError(f"Pipeline.sharing={self.sharing!r}: use 'temporal' or 'spatial'")
        if self.allreduce and len(self.allreduce) != s:
            raise ValueError(f"Pipeline.allreduce has {len(self.allreduce)} entries for {s} stages")


@dataclass(slots=True)
class Transfer:
    """One micro-batch's activation (``fwd``) or gradient (``bwd``) crossing boundary ``edge``."""

    edge: int
    fwd: bool
    m: int
    d: int
    released: float
    remaining: float
    latency: float
    started: float | None = None
    done: float | None = None

    @property
    def arrives(self) -> float | None:
        return None if self.done is None else self.done + self.latency


@dataclass
class Result:
    iteration: float
    busy: list[float]                              # compute seconds per stage (one replica)
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def utilisation(self) -> float:
        """Mean fraction of the iteration the GPUs compute."""
        return sum(self.busy) / (len(self.busy) * self.iteration)


def schedule_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order of ("F"|"B", micro-batch) on one stage: GPipe, or non-interleaved 1F1B."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", i) for i in range(m - warm, m)]
    return ops


def simulate(p: Pipeline) -> Result:
    """Run one iteration; returns its length, per-stage busy time and every boundary transfer."""
    S, D, M = len(p.t_f), p.replicas, p.micro_batches
    ops = [schedule_ops(p.schedule, s, S, M) for s in range(S)]
    nxt = [[0] * D for _ in range(S)]             # index of each (stage, replica)'s next op
    busy_until = [[0.0] * D for _ in range(S)]
    ready: dict[tuple, float] = {}               # (fwd, stage, m, d) -> when that input is there
    computing: list[tuple] = []                  # heap of (end, stage, replica, kind, m)
    arrivals: list[float] = []                   # heap of future arrival times
    shared = {(e, f): _SharedLink(p, p.links[e]) for e in range(S - 1) for f in (True, False)
              if p.links[e].shared}
    transfers: list[Transfer] = []
    last_b = [[0.0] * D for _ in range(S)]
    t = 0.0

    def deliver(tr: Transfer) -> None:
        ready[(tr.fwd, tr.edge + 1 if tr.fwd else tr.edge, tr.m, tr.d)] = tr.arrives
        heapq.heappush(arrivals, tr.arrives)

    def release(edge: int, fwd: bool, m: int, d: int) -> None:
        link = p.links[edge]
        tr = Transfer(edge, fwd, m, d, t, p.act_bytes, link.latency)
        transfers.append(tr)
        if link.shared:
            shared[(edge, fwd)].add(tr)
        else:
            tr.started, tr.done = t, t + p.act_bytes / min(link.bandwidth, link.per_transfer_cap)
            tr.remaining = 0.0
            deliver(tr)

    while True:
        # 1. Start every op whose stage is idle and whose input has arrived.
        for s in range(S):
            for d in range(D):
                i = nxt[s][d]
                if i >= len(ops[s]) or busy_until[s][d] > t + _EPS:
                    continue
                kind, m = ops[s][i]
                if (kind == "F" and s > 0) or (kind == "B" and s < S - 1):
                    when = ready.get((kind == "F", s, m, d))
                    if when is None or when > t + _EPS:
                        continue
                end = t + (p.t_f[s] if kind == "F" else p.t_b[s])
                busy_until[s][d] = end
                nxt[s][d] = i + 1
                heapq.heappush(computing, (end, s, d, kind, m))
        # 2. The next event: an op ending, an arrival, or a shared transfer finishing or released.
        while arrivals and arrivals[0] <= t + _EPS:
            heapq.heappop(arrivals)
        cands = [computing[0][0]] if computing else []
        if arrivals:
            cands.append(arrivals[0])
        cands += [e for link in shared.values() if (e := link.next_event(t)) is not None]
        if not cands:
            break
        t_next = min(cands)
        for link in shared.values():
            for tr in link.advance(t, t_next):
                deliver(tr)
        t = t_next
        # 3. Ops ending now release their sends.
        while computing and computing[0][0] <= t + _EPS:
            _, s, d, kind, m = heapq.heappop(computing)
            if kind == "F" and s < S - 1:
                release(s, True, m, d)
            elif kind == "B":
                last_b[s][d] = t
                if s > 0:
                    release(s - 1, False, m, d)
    if any(nxt[s][d] < len(ops[s]) for s in range(S) for d in range(D)):
        raise RuntimeError("simulate: the schedule deadlocked (an input never arrived)")
    allreduce = list(p.allreduce) or [0.0] * S
    end = max(last_b[s][d] + allreduce[s] for s in range(S) for d in range(D))
    busy = [M * (p.t_f[s] + p.t_b[s]) for s in range(S)]
    return Result(end, busy, transfers)


class _SharedLink:
    """One direction of a WAN boundary: the replicas' transfers share its bandwidth."""

    def __init__(self, p: Pipeline, link: Link) -> None:
        self.temporal = p.sharing == "temporal"
        self.replicas = p.replicas
        self.link = link
        self.bytes = p.act_bytes
        self.waiting: dict[int, Transfer] = {}   # token number (m·D + d) -> transfer
        self.token = 0                           # the next token to serve (temporal)

    def add(self, tr: Transfer) -> None:
        self.waiting[tr.m * self.replicas + tr.d] = tr

    def _active(self, t: float) -> list[Transfer]:
        if self.temporal:
            head = self.waiting.get(self.token)
            return [head] if head is not None and head.released <= t + _EPS else []
        return [tr for tr in self.waiting.values() if tr.released <= t + _EPS]

    def _rate(self, n: int) -> float:
        return min(self.link.per_transfer_cap, self.link.bandwidth / n)

    def next_event(self, t: float) -> float | None:
        act = self._active(t)
        if not act:
            return None
        return t + min(tr.remaining for tr in act) / self._rate(len(act))

    def advance(self, t: float, t_next: float) -> list[Transfer]:
        """Move bytes during [t, t_next]; return the transfers that finished at t_next."""
        act = self._active(t)
        finished = []
        if act:
            rate = self._rate(len(act))
            for tr in act:
                if tr.started is None:
                    tr.started = t
                tr.remaining -= rate * (t_next - t)
                if tr.remaining <= 1e-9 * self.bytes:
                    tr.remaining, tr.done = 0.0, t_next
                    finished.append(tr)
                    del self.waiting[tr.m * self.replicas + tr.d]
                    self.token += 1
        return finished
