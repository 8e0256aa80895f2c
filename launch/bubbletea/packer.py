"""Packing chunked prefill into the bubbles (atlas.md §1.8 steps 3–4), earliest fit with a guard band.

Work unit: a :class:`Chunk` = (request, tokens [lo, hi)). A request's chunks run in order on one lane
(one GPU: the inference model is resident on every GPU and the request's KV cache stays where its
prefill started), each after the previous one ended. For every chunk, in FIFO order of the requests:

- take the earliest free slot of a window, on the request's lane (or, for a request not yet started
  and not bound to a lane, on any lane), that starts no earlier than the chunk may start (the request's
  arrival, the previous chunk's end) and where ``start + cost + guard <= window end``; the guard band
  is kept free before every training op, so a chunk that runs a little long still ends before it;
- a chunk that fits nowhere is deferred, with every later chunk of its request (they depend on it);
  other requests keep packing into what is left (a short tail chunk may still fit a gap).

Training ops are never moved: the packer only ever writes into windows, and :func:`check_placements`
verifies the result (the property tests run it over many random timelines).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from launch.bubbletea.timeline import Op, Window

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Chunk:
    request: Hashable
    lo: int
    hi: int
    total: int          # the request's prompt length (the KV cache it fills)

    @property
    def tokens(self) -> int:
        return self.hi - self.lo

    @property
    def last(self) -> bool:
        return self.hi == self.total


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt of ``tokens`` tokens (from position ``done``), arrived at ``arrival`` (iteration time);
    ``lane`` binds it to a GPU (a real run's rank queue, or a request whose prefill has started)."""

    id: Hashable
    tokens: int
    arrival: float = 0.0
    lane: Hashable | None = None
    done: int = 0

    def chunks(self, size: int) -> list[Chunk]:
        if size < 1:
            raise ValueError(f"chunk size must be >= 1 token, got {size}")
        return [Chunk(self.id, lo, min(lo + size, self.tokens), self.tokens)
                for lo in range(self.done, self.tokens, size)]


@dataclass(frozen=True, slots=True)
class Placement:
    chunk: Chunk
    lane: Hashable
    start: float
    end: float
    window: Window


@dataclass
class Packing:
    placements: list[Placement] = field(default_factory=list)
    deferred: list[Chunk] = field(default_factory=list)

    def ops(self) -> list[Op]:
        """The placements as ``prefill`` ops (to draw, or to add to a utilisation)."""
        return [Op(p.lane, "prefill", p.start, p.end) for p in self.placements]

    def by_window(self) -> dict[Window, list[Placement]]:
        out: dict[Window, list[Placement]] = {}
        for p in sorted(self.placements, key=lambda p: p.start):
            out.setdefault(p.window, []).append(p)
        return out


@dataclass
class _Slot:
    window: Window
    start: float
    end: float


def pack(windows: Iterable[Window], requests: Sequence[Request], chunk_tokens: int,
         cost: Callable[[Chunk], float], guard: float) -> Packing:
    """Place the requests' chunks into the windows; see the module docstring for the rule."""
    if guard < 0:
        raise ValueError(f"guard={guard}: the guard band cannot be negative")
    free: dict[Hashable, list[_Slot]] = {}
    for w in sorted(windows, key=lambda w: (repr(w.lane), w.start)):
        free.setdefault(w.lane, []).append(_Slot(w, w.start, w.end))
    out = Packing()
    for req in requests:
        lane, ready = req.lane, req.arrival
        chunks = req.chunks(chunk_tokens)
        for i, ch in enumerate(chunks):
            p = cost(ch)
            if not p > 0:
                raise ValueError(f"cost({ch}) = {p}: a chunk must take a positive time")
            found = _earliest(free, lane, ready, p, guard)
            if found is None:
                out.deferred += chunks[i:]
                break
            lane, slots, k, t = found
            s = slots[k]
            out.placements.append(Placement(ch, lane, t, t + p, s.window))
            slots[k:k + 1] = [x for x in (_Slot(s.window, s.start, t), _Slot(s.window, t + p, s.end))
                              if x.end - x.start > _EPS]
            ready = t + p
    return out


def _earliest(free: dict, lane, ready: float, p: float, guard: float):
    best = None
    for ln in ([lane] if lane is not None else free):
        for k, s in enumerate(free.get(ln, ())):
            t = max(s.start, ready)
            if t + p <= s.end + _EPS and t + p + guard <= s.window.end + _EPS:
                if best is None or t < best[3]:
                    best = (ln, free[ln], k, t)
                break
    return best


def check_placements(ops: Iterable[Op], packing: Packing, guard: float = 0.0) -> None:
    """Raise AssertionError unless every chunk lies inside its window, keeps the guard band before the
    window's end, overlaps no training op and no other chunk on its lane, and every request's chunks
    are in token order, back to back in tokens, each after the previous one ended, on one lane."""
    training: dict = {}
    for op in ops:
        training.setdefault(op.lane, []).append(op)
    prefill: dict = {}
    for p in packing.placements:
        prefill.setdefault(p.lane, []).append(p)
        w = p.window
        assert w.lane == p.lane and w.start - _EPS <= p.start and p.end + guard <= w.end + 1e-9, \
            f"{p.chunk} at [{p.start}, {p.end}] + guard {guard} leaves its window {w}"
        for op in training.get(p.lane, ()):
            assert op.end <= p.start + 1e-9 or p.end + guard <= op.start + 1e-9, \
                f"{p.chunk} at [{p.start}, {p.end}] + guard {guard} overlaps training op {op}"
    for lane, mine in prefill.items():
        mine.sort(key=lambda p: p.start)
        for a, b in itertools.pairwise(mine):
            assert b.start >= a.end - 1e-9, f"lane {lane}: {a.chunk} and {b.chunk} overlap"
    seen: dict = {}
    for p in sorted(packing.placements, key=lambda p: p.start):
        prev = seen.get(p.chunk.request)
        if prev is not None:
            assert prev.lane == p.lane and prev.chunk.hi == p.chunk.lo and p.start >= prev.end - 1e-9, \
                f"request {p.chunk.request}: {p.chunk} does not follow {prev.chunk} on lane {prev.lane}"
        seen[p.chunk.request] = p
