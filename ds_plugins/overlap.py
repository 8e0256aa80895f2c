"""Chunked, overlapped exchanges between the dispatch buffer and the experts (parm.md §2.6, §2.7).

Shape legend: E experts, E_l = E / p local experts, p = EP size, s = ESP size, n = MP size,
r chunks, c_r capacity slots per chunk, M hidden size, F_j rows of local expert j that hold a token.

    source side   buffer [E, C_buf, M]; this rank exchanges the capacity slots [lo, lo + r·c_r)
                  (S2: its MP slice, lo = mp_rank·r·c_r, C_buf = n·r·c_r; S1: all, lo = 0, C_buf = r·c_r)
    expert side   per chunk [s, p, E_l, c_r, M]: for each ESP peer, EP source and local expert, c_r slots;
                  the experts get their filled rows only, one [F_j, M] tensor per local expert

to_experts, per chunk:   A2A over EP   [E, c_r, M] -> [p, E_l, c_r, M]
                         AG  over ESP  -> [s, p, E_l, c_r, M]
                         filled rows   -> appended to each expert's [F_j, M]
from_experts, per chunk: rows back in place, zeros in the empty slots -> [s, p, E_l, c_r, M] partial sums
                         RS  over ESP  -> [p, E_l, c_r, M]
                         A2A over EP   -> [E, c_r, M]
                         AG  over MP   (S2 only) -> [n, E, c_r, M], the MP ranks' slices side by side

The chunks run as a wavefront: at step t, stage j works on chunk t - j, and the stages of one step are
asynchronous collectives on *different* communicators (ep, esp, mp), so they run at the same time on
gloo and on NCCL. With r chunks and stage times a, b the exchange takes about a + (r-1)·max(a, b) + b
instead of r·(a + b) (the SAA time model of §2.6).

Filled rows (:class:`Rows`). With capacity factor f at most 1/f of the slots hold a token, and a gate
fills each expert's slots from 0 (ds_plugins.routing.fill), so block (chunk i, ESP peer q, EP source p',
local expert j) holds tokens in its first

    rows[i, q, p', j] = clamp(fill_e - lo - i·c_r, 0, c_r)        (fill_e, lo: those of the block's source)

slots. :class:`FillExchange` sends every source's fill to the experts along the blocks' own path, an A2A
over EP then an AG over ESP of E int32, each EP peer's with the sender's header (ds_plugins.agreement:
W = (E + p·HEADER)·4 bytes, wire W·(p-1)/p + W·(s-1) per rank, forward only: the backward reuses the rows),
which holds for any group layout and for S1, whose MP ranks send different blocks; the receiver subtracts
each source's lo (:meth:`FillExchange.rows`), so the fill can travel before the layout is known. It is the
forward's one read of device data to the host (one copy, the headers in it). The experts then run on their
F_j filled rows only; the empty slots of the returned buffer are zeros (combine never reads them; the
reduce-scatter sums them). Without skipping, every slot counts as filled (:meth:`Rows.every`) and the
experts see all E_l·r·s·p·c_r rows, as DeepSpeed's do.

The two exchanges are each other's autograd dual: the backward of to_experts is from_experts (A2A <-> A2A,
AG <-> RS, keeping the filled rows <-> putting them back with zeros, and the S2 split's AG over MP), the
backward of from_experts is to_experts (its MP all-gather feeds a replicated decode, so every MP rank holds
the full gradient and keeps its own slice, as DeepSpeed's ``_GatherTokens.backward`` does). An empty
slot's gradient is zero either way: combine's backward puts zeros there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from commweave import comm
from ds_plugins.agreement import HEADER, LANE
from ds_plugins.groups import ParmGroups


@dataclass(frozen=True)
class Layout:
    groups: ParmGroups
    num_experts: int
    chunks: int
    chunk_slots: int
    mp_split: bool
    """S2: exchange only this rank's MP slice of the capacity, all-gather the combined slices over MP."""

    @property
    def capacity(self) -> int:
        """C_buf, the capacity dimension of the source-side buffer."""
        n = self.groups.mp_size if self.mp_split else 1
        return n * self.chunks * self.chunk_slots


class Rows:
    """The expert-side rows that hold a token, from ``counts`` [r][s][p][E_l] (host ints: the filled prefix
    of every block, see the module docstring).

    ``index[i][j]``: local expert j's filled rows in chunk i, as row numbers of the chunk's flattened
    [s, p, E_l, c_r] blocks, in (q, p', slot) order; expert j's tensor holds them chunk after chunk, those
    of chunk i from row ``offset[i][j]``; ``sizes[j]`` = F_j. Built on the host from host ints (no read
    of a device tensor); the row numbers go to the device in one copy, asynchronous on a GPU (pinned).
    """

    def __init__(self, counts: list, chunk_slots: int, device: torch.device) -> None:
        r, s, p, e_l = len(counts), len(counts[0]), len(counts[0][0]), len(counts[0][0][0])
        per = [[sum(counts[i][q][b][j] for q in range(s) for b in range(p)) for j in range(e_l)]
               for i in range(r)]
        c = torch.tensor(counts, dtype=torch.int64).view(r, s, p, e_l)
        filled = torch.arange(chunk_slots) < c.permute(0, 3, 1, 2).unsqueeze(-1)        # [r, E_l, s, p, c_r]
        rows = torch.arange(s * p * e_l * chunk_slots).view(s, p, e_l, chunk_slots).permute(2, 0, 1, 3)
        pieces = _to_device(rows.expand(r, *rows.shape)[filled], device).split([n for i in per for n in i])
        self.index = [pieces[i * e_l: (i + 1) * e_l] for i in range(r)]
        self.offset = [[sum(per[h][j] for h in range(i)) for j in range(e_l)] for i in range(r)]
        self.sizes = [sum(per[i][j] for i in range(r)) for j in range(e_l)]
        self.full = all(n == s * p * chunk_slots for i in per for n in i)

    @classmethod
    def every(cls, lay: Layout, device: torch.device) -> Rows:
        """Every slot counts as filled (no skipping)."""
        g = lay.groups
        block = [[[lay.chunk_slots] * (lay.num_experts // g.ep_size)] * g.ep_size] * g.esp_size
        return cls([block] * lay.chunks, lay.chunk_slots, device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU from pinned memory, asynchronously (a copy from pageable
    memory would wait for the stream)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class FillExchange:
    """Every source's fill counts on their way to the experts, with its header (ds_plugins.agreement): the
    A2A over EP starts at construction (right after routing, so that it overlaps the dispatch), the AG of
    what arrived over ``gather`` (the ESP group, or None) in :meth:`read`, which copies it all to the host
    in one read: the only one of a sync-free forward (ds_plugins.schedules.sync_free).

    fill: [E] int32 on the device, each expert's filled prefix of this rank's buffer; head: [HEADER] int32,
    sent to every EP peer. Sizes E + p·HEADER words whatever the token count, so ranks whose shapes differ
    still meet in the same collectives and learn it from the headers.
    """

    def __init__(self, fill: torch.Tensor, head: torch.Tensor, g: ParmGroups, gather) -> None:
        send = torch.cat([fill.to(torch.int32).view(g.ep_size, -1), head.expand(g.ep_size, -1)], 1)
        self.gather, self.work = gather, None
        if g.ep is None:
            self.recv = send
        else:
            self.recv = torch.empty_like(send)                  # [p, E_l + HEADER]
            self.work = comm.all_to_all(self.recv, send, g.ep, async_op=True)

    def read(self) -> tuple[list[list[int]], list]:
        """The headers of every rank this one saw, and the counts received [s', p, E_l] (host ints)."""
        if self.work is not None:
            self.work.wait()
        got = self.recv.unsqueeze(0)
        if self.gather is not None:
            got = self.recv.new_empty((comm.size(self.gather), *self.recv.shape))
            comm.all_gather(got, self.recv, self.gather)        # [s, p, E_l + HEADER]: every ESP peer's
        host = got.tolist()                                     # the one copy to the host
        e_l = len(host[0][0]) - HEADER
        self.lanes = [[row[e_l + LANE] for row in peer] for peer in host]   # each source's MP rank
        return [row[e_l:] for peer in host for row in peer], [[row[:e_l] for row in peer] for peer in host]

    def rows(self, counts: list, lay: Layout) -> Rows:
        """The layout's filled rows from the counts :meth:`read` returned (each source's whole fill_e).

        S2 (``lay.mp_split``) exchanges the slots [lo, lo + r·c_r) of its MP rank q's slice, lo = q·r·c_r:
        the fill of each source, less its lo (its MP rank rides in its header), so that the fill can
        travel before the layout is known (a capacity agreed on the headers). A layout without ESP whose
        counts were gathered over it anyway ("deepspeed": its experts all-reduce over ESP, and the
        headers must reach every rank of the layer) keeps its own: its ESP peers received the same (the
        headers' route hashes say so)."""
        g, c_r = lay.groups, lay.chunk_slots
        lanes = self.lanes
        if len(counts) != g.esp_size:
            mine = comm.rank(self.gather)
            counts, lanes = [counts[mine]], [lanes[mine]]
        span = lay.chunks * c_r if lay.mp_split else 0
        blocks = [[[[min(max(f - q * span - i * c_r, 0), c_r) for f in row]
                    for q, row in zip(lane, peer, strict=True)]
                   for lane, peer in zip(lanes, counts, strict=True)] for i in range(lay.chunks)]
        return Rows(blocks, c_r, self.recv.device)


def _wavefront(chunks: int, stages: list[tuple[Callable, bool]], finish: Callable[[int], None]) -> None:
    """Run ``stages`` over every chunk as a pipeline; ``finish(i)`` after chunk i's last stage.

    A stage is ``(fn, communicates)``: ``fn(i)`` launches an asynchronous collective and returns its Work,
    or, on a group of one rank, does the local equivalent and returns None. A local stage runs in the same
    step as the collective after it (it needs no wait), so only communicating stages add pipeline depth.
    """
    units: list[list[Callable]] = [[]]
    for fn, communicates in stages:
        units[-1].append(fn)
        if communicates:
            units.append([])
    tail = units.pop()

    def launch(unit: list[Callable], i: int):
        work = None
        for fn in unit:
            work = fn(i)
        return work

    def done(i: int) -> None:
        for fn in tail:
            fn(i)
        finish(i)

    depth = len(units)
    for t in range(chunks + depth - 1):
        works = [launch(unit, t - j) for j, unit in enumerate(units) if 0 <= t - j < chunks]
        if t - depth >= 0:
            done(t - depth)  # local copy of the chunk completed last step, while this step's comm runs
        comm.wait_all(works)
    done(chunks - 1)


def _to_experts(buf: torch.Tensor, lay: Layout, rows: Rows) -> tuple[torch.Tensor, ...]:
    """[E, C_buf, M] source buffer -> the filled rows of each local expert, E_l tensors [F_j, M]."""
    g, c_r, r = lay.groups, lay.chunk_slots, lay.chunks
    e_l, m = lay.num_experts // g.ep_size, buf.shape[-1]
    lo = g.mp_rank * r * c_r if lay.mp_split else 0
    outs = tuple(buf.new_empty((size, m)) for size in rows.sizes)
    recv: dict[int, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}

    def a2a(i: int):
        send = buf[:, lo + i * c_r: lo + (i + 1) * c_r].contiguous().view(g.ep_size, e_l, c_r, m)
        if g.ep is None:
            recv[i] = send
            return None
        recv[i] = torch.empty_like(send)
        return comm.all_to_all(recv[i], send, g.ep, async_op=True)

    def ag(i: int):
        if g.esp is None:
            gathered[i] = recv.pop(i).unsqueeze(0)
            return None
        gathered[i] = buf.new_empty((g.esp_size, g.ep_size, e_l, c_r, m))
        return comm.all_gather(gathered[i], recv.pop(i), g.esp, async_op=True)

    def finish(i: int) -> None:
        blocks = gathered.pop(i).view(-1, m)                 # [s·p·E_l·c_r, M]
        for out, index, start in zip(outs, rows.index[i], rows.offset[i], strict=True):
            torch.index_select(blocks, 0, index, out=out[start: start + index.numel()])

    _wavefront(r, [(a2a, g.ep is not None), (ag, g.esp is not None)], finish)
    return outs


def _from_experts(ys: tuple[torch.Tensor, ...], lay: Layout, rows: Rows) -> torch.Tensor:
    """E_l expert outputs [F_j, M] (partial sums over ESP) -> [E, C_buf, M] source buffer, empty slots 0."""
    g, c_r, r = lay.groups, lay.chunk_slots, lay.chunks
    e, m, y0 = lay.num_experts, ys[0].shape[-1], ys[0]
    n = g.mp_size if lay.mp_split else 1
    out = y0.new_empty((e, n, r, c_r, m))
    reduced: dict[int, torch.Tensor] = {}
    back: dict[int, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}

    def rs(i: int):
        shape = (g.esp_size, g.ep_size, e // g.ep_size, c_r, m)
        partial = y0.new_empty(shape) if rows.full else y0.new_zeros(shape)
        blocks = partial.view(-1, m)
        for y, index, start in zip(ys, rows.index[i], rows.offset[i], strict=True):
            blocks.index_copy_(0, index, y[start: start + index.numel()])
        if g.esp is None:
            reduced[i] = partial[0]
            return None
        reduced[i] = y0.new_empty(partial.shape[1:])
        return comm.reduce_scatter(reduced[i], partial, g.esp, async_op=True)

    def a2a(i: int):
        send = reduced.pop(i)
        if g.ep is None:
            back[i] = send
            return None
        back[i] = torch.empty_like(send)
        return comm.all_to_all(back[i], send, g.ep, async_op=True)

    def ag(i: int):
        if n == 1:
            gathered[i] = back.pop(i).view(1, e, c_r, m)
            return None
        gathered[i] = y0.new_empty((n, e, c_r, m))
        return comm.all_gather(gathered[i], back.pop(i), g.mp, async_op=True)

    def finish(i: int) -> None:
        out[:, :, i] = gathered.pop(i).transpose(0, 1)

    _wavefront(r, [(rs, g.esp is not None), (a2a, g.ep is not None), (ag, n > 1)], finish)
    return out.view(e, n * r * c_r, m)


class _ToExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, lay, rows):
        ctx.lay, ctx.rows = lay, rows
        return _to_experts(buf, lay, rows)

    @staticmethod
    def backward(ctx, *grads):
        return _from_experts(grads, ctx.lay, ctx.rows), None, None


class _FromExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lay, rows, *ys):
        ctx.lay, ctx.rows = lay, rows
        return _from_experts(ys, lay, rows)

    @staticmethod
    def backward(ctx, grad):
        return None, None, *_to_experts(grad.contiguous(), ctx.lay, ctx.rows)


def to_experts(buf: torch.Tensor, lay: Layout, rows: Rows) -> tuple[torch.Tensor, ...]:
    """Dispatch exchange; ``buf`` is [E, C_buf, M] with ``C_buf == lay.capacity``; returns E_l [F_j, M]."""
    if buf.shape[1] != lay.capacity:
        raise ValueError(f"dispatch buffer has capacity {buf.shape[1]}, the layout expects {lay.capacity}")
    return _ToExperts.apply(buf, lay, rows)


def from_experts(ys: list[torch.Tensor], lay: Layout, rows: Rows) -> torch.Tensor:
    """Combine exchange; ``ys`` are the E_l experts' outputs [F_j, M] (partial sums over ESP)."""
    return _FromExperts.apply(lay, rows, *ys)
