"""Chunked, overlapped exchanges between the dispatch buffer and the experts (parm.md §2.6, §2.7).

Shape legend: E experts, E_l = E / p local experts, p = EP size, s = ESP size, n = MP size,
r chunks, c_r capacity slots per chunk, M hidden size.

    source side   buffer [E, C_buf, M]; this rank exchanges the capacity slots [lo, lo + r·c_r)
                  (S2: its MP slice, lo = mp_rank·r·c_r, C_buf = n·r·c_r; S1: all, lo = 0, C_buf = r·c_r)
    expert side   [E_l, r, s, p, c_r, M]: for each local expert, chunk, ESP peer and EP source, c_r slots

to_experts, per chunk:   A2A over EP   [E, c_r, M] -> [p, E_l, c_r, M]
                         AG  over ESP  -> [s, p, E_l, c_r, M]
from_experts, per chunk: RS  over ESP  [s, p, E_l, c_r, M] partial sums -> [p, E_l, c_r, M]
                         A2A over EP   -> [E, c_r, M]
                         AG  over MP   (S2 only) -> [n, E, c_r, M], the MP ranks' slices side by side

The chunks run as a wavefront: at step t, stage j works on chunk t - j, and the stages of one step are
asynchronous collectives on *different* communicators (ep, esp, mp), so they run at the same time on
gloo and on NCCL. With r chunks and stage times a, b the exchange takes about a + (r-1)·max(a, b) + b
instead of r·(a + b) (the SAA time model of §2.6).

The two exchanges are each other's autograd dual: the backward of to_experts is from_experts (A2A <-> A2A,
AG <-> RS, and the S2 split's AG over MP), the backward of from_experts is to_experts (its MP all-gather
feeds a replicated decode, so every MP rank holds the full gradient and keeps its own slice, as DeepSpeed's
``_GatherTokens.backward`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from commweave import comm
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

    def expert_shape(self, hidden: int) -> tuple[int, ...]:
        g = self.groups
        return (self.num_experts // g.ep_size, self.chunks, g.esp_size, g.ep_size, self.chunk_slots, hidden)


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


def _to_experts(buf: torch.Tensor, lay: Layout) -> torch.Tensor:
    """[E, C_buf, M] source buffer -> [E_l, r, s, p, c_r, M] expert input."""
    g, c_r, r = lay.groups, lay.chunk_slots, lay.chunks
    e_l, m = lay.num_experts // g.ep_size, buf.shape[-1]
    lo = g.mp_rank * r * c_r if lay.mp_split else 0
    out = buf.new_empty(lay.expert_shape(m))
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
        out[:, i] = gathered.pop(i).permute(2, 0, 1, 3, 4)

    _wavefront(r, [(a2a, g.ep is not None), (ag, g.esp is not None)], finish)
    return out


def _from_experts(y: torch.Tensor, lay: Layout) -> torch.Tensor:
    """[E_l, r, s, p, c_r, M] expert output (partial sums over ESP) -> [E, C_buf, M] source buffer."""
    g, c_r, r = lay.groups, lay.chunk_slots, lay.chunks
    e, m = lay.num_experts, y.shape[-1]
    n = g.mp_size if lay.mp_split else 1
    out = y.new_empty((e, n, r, c_r, m))
    reduced: dict[int, torch.Tensor] = {}
    back: dict[int, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}

    def rs(i: int):
        partial = y[:, i].permute(1, 2, 0, 3, 4).contiguous()  # [s, p, E_l, c_r, M]
        if g.esp is None:
            reduced[i] = partial[0]
            return None
        reduced[i] = y.new_empty(partial.shape[1:])
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
        gathered[i] = y.new_empty((n, e, c_r, m))
        return comm.all_gather(gathered[i], back.pop(i), g.mp, async_op=True)

    def finish(i: int) -> None:
        out[:, :, i] = gathered.pop(i).transpose(0, 1)

    _wavefront(r, [(rs, g.esp is not None), (a2a, g.ep is not None), (ag, n > 1)], finish)
    return out.view(e, n * r * c_r, m)


class _ToExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, lay):
        ctx.lay = lay
        return _to_experts(buf, lay)

    @staticmethod
    def backward(ctx, grad):
        return _from_experts(grad.contiguous(), ctx.lay), None


class _FromExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, lay):
        ctx.lay = lay
        return _from_experts(y, lay)

    @staticmethod
    def backward(ctx, grad):
        return _to_experts(grad.contiguous(), ctx.lay), None


def to_experts(buf: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Dispatch exchange; ``buf`` is [E, C_buf, M] with ``C_buf == lay.capacity``."""
    if buf.shape[1] != lay.capacity:
        raise ValueError(f"dispatch buffer has capacity {buf.shape[1]}, the layout expects {lay.capacity}")
    return _ToExperts.apply(buf, lay)


def from_experts(y: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Combine exchange; ``y`` is [E_l, r, s, p, c_r, M] (partial sums over ESP)."""
    return _FromExperts.apply(y, lay)
