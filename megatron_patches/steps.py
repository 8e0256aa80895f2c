"""One rank's share of a WallFacer call: its settings and kept buffers (``Run``), one team block attended
and merged into the running output (forward), one block's gradients added into the accumulators.

Shape legend as in wallfacer.py: s local rows, b batch, h query heads, g K/V heads, d head dim, C team
size; "team" tensors hold the team's C·s rows sorted by stream position (rowmap.py).
"""

from __future__ import annotations

import math

import torch

from megatron_patches import memory, packing
from megatron_patches.block import backward_calls, forward_calls
from megatron_patches.groups import WallFacerGroups, cached_groups
from megatron_patches.rowmap import Call, TeamRows, block_calls, team_rows

_KEEP_CPU_BUFFERS = [True]


def keep_cpu_buffers(enabled: bool) -> None:
    """Whether CPU calls keep their dead buffers for the next call (the default, Run.empty) or allocate
    and free them as CUDA calls do (what a caching allocator's peak sees; benchmarks.attention)."""
    _KEEP_CPU_BUFFERS[0] = bool(enabled)
    if not enabled:
        release_buffers()


def kept_buffer_bytes() -> int:
    """Bytes of the CPU buffers kept between calls (Run.empty), over every cached layout of this process."""
    return sum(t.numel() * t.element_size() for g in cached_groups() for t in g.scratch.values())


def release_buffers() -> None:
    """Free the CPU buffers kept between calls; the next call allocates them again."""
    for g in cached_groups():
        g.scratch.clear()


class Run:
    """What one call needs besides tensors: groups, kernel, scale, mask, backward variant, whether the
    team's Q/K/V are kept for the backward, and which stream positions every rank's rows hold
    (``shards``, packing.py: one run list per group rank; None: the dense sequence in the layout's
    chunks, sized by the first call's rows)."""

    def __init__(self, groups: WallFacerGroups, kernel, scale: float, causal: bool, mode: str,
                 keep: bool = True, shards: tuple | None = None) -> None:
        self.groups, self.kernel, self.scale, self.causal, self.mode = groups, kernel, scale, causal, mode
        self.keep, self.shards = keep, shards
        lay = groups.layout
        self.lay, self.me = lay, groups.rank
        self._rows: dict[int, TeamRows] = {}
        self._calls: dict[tuple[int, int], tuple] = {}

    def bind(self, s_local: int) -> None:
        """Fix the dense shards for ``s_local`` rows per rank (a no-op once shards are known)."""
        if self.shards is None:
            lay = self.lay
            self.shards = packing.shards(packing.dense(lay.world * s_local), lay.layout, lay.world)

    def rows(self, team: int) -> TeamRows:
        """The team's sorted rows (rowmap.py), members in all-gather order."""
        if team not in self._rows:
            self._rows[team] = team_rows(tuple(self.shards[r] for r in self.lay.team_ranks(team)))
        return self._rows[team]

    def calls(self, q_team: int, kv_team: int) -> tuple[Call, ...]:
        """Kernel calls (q0, q1, k0, k1, diagonal) in sorted rows for one team block (rowmap.block_calls)."""
        key = (q_team, kv_team)
        if key not in self._calls:
            self._calls[key] = block_calls(self.rows(q_team), self.rows(kv_team), self.causal,
                                           q_team == kv_team)
        return self._calls[key]

    def empty(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer that is dead when this forward or backward returns, kept for the next call on CPU.

        CPU torch has no caching allocator: glibc gives large freed blocks back to the kernel, so a
        call would page-fault its multi-MB accumulators and receive buffers in again each time (about
        4k faults per step at P = 8, C = 2, ~4% of a rank's CPU). CUDA's caching allocator already
        reuses memory, so there this allocates. One flat buffer per name and layout, grown to the largest
        request: the forward and the backward use the same names for buffers of the same role (they
        never live at once). Outputs and tensors saved for the backward are never such buffers.
        """
        if device.type != "cpu" or not _KEEP_CPU_BUFFERS[0]:
            return torch.empty(shape, dtype=dtype, device=device)
        n, buf = math.prod(shape), self.groups.scratch.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self.groups.scratch[name] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    def gather_buffers(self, names: dict):
        """gather_team's ``empty``: kept buffers for the keys in ``names``, new ones otherwise."""
        def empty(key, shape, dtype, device):
            if key in names:
                return self.empty(names[key], shape, dtype, device)
            return torch.empty(shape, dtype=dtype, device=device)
        return empty

    def pieces(self, team: int, first: int, stop: int) -> list[tuple[slice, slice, int, slice]]:
        """Where a result over the team's sorted rows [first, stop) goes in an all-gather-order
        accumulator [C, s, ...]: (rows of the result, sorted team rows, member, that member's rows)."""
        return self.rows(team).pieces(first, stop)


def bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] memory seen as [b, h, s, d] (a view: kernels take strided inputs)."""
    return t.permute(1, 2, 0, 3)


def by_member(team: torch.Tensor, c: int) -> tuple[int, ...]:
    """Shape of an all-gather-order accumulator for a [C·s, ...] team tensor: [C, s, ...]."""
    return (c, team.shape[0] // c, *team.shape[1:])


def _merge(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Online softmax: fold a block's (o, lse) into the running (o, lse), in place.

    lse' = log(e^lse + e^lse_blk);  o' = e^(lse − lse')·o + e^(lse_blk − lse')·o_blk.
    logaddexp keeps lse = −inf (no key yet) exact: the first block is copied.
    """
    new = torch.logaddexp(lse, lse_blk)
    o.mul_(torch.exp(lse - new).unsqueeze(-1)).addcmul_(o_blk, torch.exp(lse_blk - new).unsqueeze(-1))
    lse.copy_(new)


@memory.kernel_part()  # priced by the attention curves, not as memory traffic (memory.py)
def attend(run: Run, q_team: int, q, kv, kv_team: int, o, lse, first: bool = False) -> None:
    """Team queries ``q`` [b,h,C·s,d] against one team's K/V ``kv`` [2, C·s, b, g, d] (rows sorted),
    merged into ``o`` [C, s, b, h, d] (all-gather order) and ``lse`` [b, h, C·s] (sorted).
    ``first``: the calls cover every row and nothing was merged yet, so the blocks are copied."""
    k, v = bhsd(kv[0]), bhsd(kv[1])
    for (q0, q1, *_), o_b, lse_b in forward_calls(run.kernel, q, k, v, run.calls(q_team, kv_team), run.scale):
        for res, srt, member, wire in run.pieces(q_team, q0, q1):
            if first:
                bhsd(o[member, wire]).copy_(o_b[:, :, res])
                lse[:, :, srt].copy_(lse_b[:, :, res])
            else:
                _merge(bhsd(o[member, wire]), lse[:, :, srt], o_b[:, :, res], lse_b[:, :, res])


@memory.kernel_part()
def attend_backward(run: Run, q_team: int, qd, o, lse, kv, kv_team: int, dq, dkv) -> None:
    """Gradients of one block, added into the all-gather-order accumulators dq [C, s, b, h, d] and
    dkv [C, 2, s, b, g, d].

    ``qd`` holds the team's q and dO, ``o`` an O' with the team's D = rowsum(dO∘O) (_o_for_delta),
    each [C·s, b, h, d], rows sorted.
    """
    q, do, o = bhsd(qd[0]), bhsd(qd[1]), bhsd(o)
    k, v = bhsd(kv[0]), bhsd(kv[1])
    blocks = backward_calls(run.kernel, do, q, k, v, o, lse, run.calls(q_team, kv_team), run.scale)
    for (q0, q1, k0, k1, _), dq_b, dk_b, dv_b in blocks:
        for res, _, member, wire in run.pieces(q_team, q0, q1):
            bhsd(dq[member, wire]).add_(dq_b[:, :, res])
        for res, _, member, wire in run.pieces(kv_team, k0, k1):
            bhsd(dkv[member, 0, wire]).add_(dk_b[:, :, res])
            bhsd(dkv[member, 1, wire]).add_(dv_b[:, :, res])


def dkv_shape(kv0: torch.Tensor, c: int) -> tuple[int, ...]:
    """All-gather-order dK/dV accumulator of a [2, C·s, b, g, d] K/V: [C, 2, s, b, g, d]."""
    return (c, 2, kv0.shape[1] // c, *kv0.shape[2:])
