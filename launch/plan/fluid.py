"""One direction of a WAN link as a fluid resource, shared by the transfers crossing it.

TCP shares a bottleneck per *connection*: a transfer striped over n connections (mechanism A,
atlas.md §1.3) gets n shares, and no connection goes faster than its window allows (window/RTT,
the same for every connection of one path). So every active connection runs at
    c(t) = min(window/RTT, bandwidth / W(t)),   W(t) = connections of the active transfers,
and a transfer of n connections moves n·c(t) bytes/s. Progress is kept in per-connection "virtual
bytes" V(t) = ∫c dt: a transfer that becomes active at V0 with b bytes finishes when V reaches
V0 + b/n, so each event costs O(log transfers) however many are queued.

Which transfers are active:
  * ``spatial`` (stock TCP): every released transfer at once;
  * ``temporal`` (ATLAS mechanism C, atlas.md §1.5): a token ring per (boundary, direction) serves
    one transfer at a time in token order (micro-batch, then replica); the link waits for the next
    token's transfer even if a later one is already released (the runtime's rings in
    launch/net/sharing.py do exactly this). Flows that belong to no ring (a data-parallel all-reduce
    over the WAN) are always active, alongside the ring heads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import count

_EPS = 1e-12


@dataclass(slots=True, eq=False)
class Flow:
    """Bytes crossing one WAN direction. ``key`` identifies it to the simulator."""

    key: tuple
    released: float
    nbytes: float
    streams: int            # TCP connections carrying it
    latency: float          # one-way: its data arrives this long after its last byte leaves
    started: float | None = None
    done: float | None = None

    @property
    def arrives(self) -> float | None:
        return None if self.done is None else self.done + self.latency


def link_for(links: dict, src: str, dst: str, bandwidth: float, stream_cap: float, t: float) -> WanDirection:
    """The direction src -> dst of ``links`` (made at ``t`` on first use); one path has one bandwidth and
    one window, so a second caller naming other ones is an error."""
    link = links.get((src, dst))
    if link is None:
        link = links[(src, dst)] = WanDirection(bandwidth, stream_cap)
        link.t = t
    elif (link.bandwidth, link.stream_cap) != (bandwidth, stream_cap):
        raise ValueError(f"simulate: WAN {src}->{dst} given (bandwidth, stream_cap) "
                         f"{(link.bandwidth, link.stream_cap)} and {(bandwidth, stream_cap)}: one path, "
                         "one bandwidth and one window")
    return link


class WanDirection:
    """``bandwidth`` bytes/s from one data center to another; one connection reaches ``stream_cap``."""

    def __init__(self, bandwidth: float, stream_cap: float) -> None:
        self.bandwidth = bandwidth
        self.stream_cap = stream_cap
        self.v = 0.0                          # virtual bytes per connection served so far
        self.t = 0.0
        self.weight = 0                       # connections of the active flows
        self.active: list[tuple] = []         # heap of (V at which it finishes, seq, flow)
        self.rings: dict[object, tuple[dict[int, Flow], list[int]]] = {}   # ring -> (waiting, [token])
        self.seq = count()
        self.carried = 0.0                    # bytes of the flows finished (the WAN-bytes column)

    def _start(self, flow: Flow, t: float) -> None:
        flow.started = t
        self.weight += flow.streams
        heapq.heappush(self.active, (self.v + flow.nbytes / flow.streams, next(self.seq), flow))

    def add(self, flow: Flow, t: float, ring: object | None = None, token: int | None = None) -> None:
        """A flow released at ``t`` (the link's clock must be at t): free, or token ``token`` of ``ring``."""
        if ring is None:
            self._start(flow, t)
            return
        waiting, head = self.rings.setdefault(ring, ({}, [0]))
        waiting[token] = flow
        if token == head[0]:
            self._start(flow, t)

    def rate(self) -> float:
        """Bytes/s of one active connection."""
        return min(self.stream_cap, self.bandwidth / self.weight) if self.weight else 0.0

    def _finish_time(self, v_end: float) -> float:
        return self.t + max(0.0, v_end - self.v) / self.rate()

    def next_event(self) -> float | None:
        """When the first active flow finishes at the current rate (None: nothing active)."""
        return self._finish_time(self.active[0][0]) if self.active else None

    def advance(self, t_next: float) -> list[Flow]:
        """Move bytes up to t_next; the flows that finished then (their ring's next flow starts).

        A flow finishes when its finish time (the same expression as :meth:`next_event`) is not after
        t_next: decided in time, not in bytes, so a remainder below the clock's resolution cannot stall."""
        finished, v_end = [], self.v + self.rate() * (t_next - self.t)
        while self.active and self._finish_time(self.active[0][0]) <= t_next + _EPS * max(1.0, t_next):
            v_end = max(v_end, self.active[0][0])
            finished.append(heapq.heappop(self.active)[2])
        self.v, self.t = v_end, t_next
        for f in finished:
            f.done = t_next
            self.weight -= f.streams
            self.carried += f.nbytes
        for f in finished:
            for waiting, head in self.rings.values():
                if waiting.get(head[0]) is f:
                    del waiting[head[0]]
                    head[0] += 1
                    nxt = waiting.get(head[0])
                    if nxt is not None:
                        self._start(nxt, t_next)
                    break
        return finished
