"""Ulysses x WallFacer: a head all-to-all inside groups of U ranks, WallFacer across the P/U groups.

DeepSpeed-Ulysses (arXiv 2309.14509) trades the sequence shard for a head shard with one all-to-all
each way; it needs heads divisible by P and moves every byte across the whole group. WallFacer
(arXiv 2407.00611) needs no head count and cuts the point-to-point bytes by C. The hybrid runs the
all-to-all over U consecutive CP ranks (a node, where the fast links are) and WallFacer with team size
C over the P' = P/U groups, on U·s rows and h/U heads (wallfacer.md §10, as USP/LoongTrain stack
Ulysses on a ring; WallFacer's sub-rings in place of the ring are new).

Rows. CP rank r = γ·U + m is member m of Ulysses group γ and rank γ of the *outer* group m (the U
outer groups are the ranks with the same m: they hold the same heads). After the all-to-all outer rank
γ holds the U members' rows one member after the other, so its runs of stream positions are theirs in
that order (:func:`outer_shards`); WallFacer's team gather sorts rows by position anyway (rowmap.py), so
no reordering happens here. With Megatron's zigzag layout group γ holds chunks γU … γU+U−1 and
2P−1−γU−(U−1) … 2P−1−γU (of every document, packed), i.e. coarse chunks γ and 2P'−1−γ of 2P' (a coarse
chunk is U chunks): the zigzag layout over P' ranks, so the causal work stays balanced.

Heads. Member m takes query heads [m·h/U, (m+1)·h/U). K/V heads are sent un-expanded: with g K/V
heads, g divisible by U gives member m heads [m·g/U, (m+1)·g/U); U divisible by g gives it the one
head its query heads read (head m·g/U, rounded down), replicated to U/g members, the least any
head split can send; their gradients are summed back. Other (g, U) would split a K/V head's query
heads unevenly between members and are refused.

Shape legend: s local rows, b batch, h query heads, g K/V heads, d head dim, U Ulysses size,
n = h/U query heads and n_kv K/V heads per member.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from commweave import comm
from megatron_patches.groups import subgroup
from megatron_patches.packing import merge_runs

ULYSSES, OUTER = "wallfacer.ulysses", "wallfacer.outer"


def ulysses_error(world: int, ulysses_size: int, heads: int, kv_heads: int) -> str | None:
    """Why U cannot split ``world`` CP ranks with these head counts, or None."""
    u = ulysses_size
    if not isinstance(u, int) or u < 1 or world % u:
        divisors = [x for x in range(1, world + 1) if world % x == 0]
        return f"ulysses_size U={u!r} must divide the P={world} context-parallel ranks (valid: {divisors})"
    if heads % u:
        return f"ulysses_size U={u}: the {heads} query heads (per tensor-parallel rank) must divide by U"
    if kv_heads % u and u % kv_heads:
        return (f"ulysses_size U={u}: the {kv_heads} K/V heads (per tensor-parallel rank) must be a multiple "
                f"of U or divide U (then each is replicated to U/{kv_heads} ranks); other splits would "
                f"give a K/V head's query heads to ranks unevenly")
    return None


def kv_heads_of(member: int, kv_heads: int, ulysses_size: int) -> list[int]:
    """The K/V heads member ``member`` of a Ulysses group needs (their query heads read only those)."""
    n = max(1, kv_heads // ulysses_size)
    first = member * kv_heads // ulysses_size
    return list(range(first, first + n))


def outer_shards(shards: tuple, u: int) -> tuple:
    """The runs (packing.py) of the P/U outer ranks: outer rank γ's rows are CP ranks γU … γU+U−1's rows,
    member after member (what the all-to-all delivers)."""
    return tuple(merge_runs([run for r in range(g * u, (g + 1) * u) for run in shards[r]])
                 for g in range(len(shards) // u))


@dataclass
class HybridGroups:
    """One rank's Ulysses group (U consecutive CP ranks) and outer group (the P/U ranks with its member
    index); ``member`` m and ``index`` γ with CP rank γ·U + m."""

    ulysses: object
    outer: object
    member: int
    index: int
    size: int


_cache: dict[tuple, HybridGroups] = {}


def hybrid_groups(cp_group, u: int) -> HybridGroups:
    """The cached groups of this rank for Ulysses size ``u`` over ``cp_group``; members-only and lazy
    (every CP rank makes the Ulysses group, then the outer group: one order everywhere, groups.py)."""
    key = (id(cp_group), u)
    if key not in _cache:
        world, me = comm.size(cp_group), comm.rank(cp_group)
        index, member = divmod(me, u)
        cp_ranks = [comm.global_rank(cp_group, r) for r in range(world)]
        groups = []
        for name, members in ((ULYSSES, [index * u + m for m in range(u)]),
                              (OUTER, [j * u + member for j in range(world // u)])):
            want = [cp_ranks[r] for r in members]
            group = subgroup(want, name)
            got = [comm.global_rank(group, i) for i in range(len(members))]
            if got != want:  # the all-to-all and WallFacer number ranks in CP order
                raise RuntimeError(f"{name} group orders its ranks {got}, expected {want}")
            groups.append(group)
        _cache[key] = HybridGroups(groups[0], groups[1], member, index, u)
    return _cache[key]


class _Shape:
    """What both all-to-alls of one call need: groups, sizes, the K/V head index."""

    def __init__(self, hg: HybridGroups, q: torch.Tensor, k: torch.Tensor) -> None:
        self.hg, self.u = hg, hg.size
        self.s, self.b, self.h, self.d = q.shape
        self.g = k.shape[2]
        self.n, self.n_kv = self.h // self.u, max(1, self.g // self.u)
        self.kv_index = torch.tensor([i for m in range(self.u) for i in kv_heads_of(m, self.g, self.u)],
                                     device=q.device)
        self.kv_all = self.kv_index.tolist() == list(range(self.g))  # no head replicated: no selection

    def rows(self, recv: torch.Tensor) -> torch.Tensor:
        """recv [U, s, b, ·, d] (member-major) → [U·s, b, ·, d], a view."""
        return recv.view(self.u * self.s, *recv.shape[2:])

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send, self.hg.ulysses)
        return recv


def _by_member(x: torch.Tensor, u: int) -> torch.Tensor:
    """[s, b, U·n, d] → [U, s, b, n, d] (a view where the strides allow)."""
    s, b, h, d = x.shape
    return x.reshape(s, b, u, h // u, d).permute(2, 0, 1, 3, 4)


class _ToHeads(torch.autograd.Function):
    """(q, k, v) sequence-sharded [s, b, ·, d] → head-sharded [U·s, b, ·, d]: one all-to-all for all three."""

    @staticmethod
    def forward(ctx, sh: _Shape, q, k, v):
        u, n, n_kv = sh.u, sh.n, sh.n_kv
        send = q.new_empty(u, sh.s, sh.b, n + 2 * n_kv, sh.d)
        send[..., :n, :].copy_(_by_member(q, u))
        for j, t in enumerate((k, v)):
            heads = t if sh.kv_all else t.index_select(2, sh.kv_index)
            send[..., n + j * n_kv:n + (j + 1) * n_kv, :].copy_(_by_member(heads, u))
        rows = sh.rows(sh.exchange(send))  # [U·s, b, n + 2n', d]; q', k', v' are views of it
        ctx.sh = sh
        return rows[:, :, :n], rows[:, :, n:n + n_kv], rows[:, :, n + n_kv:]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        sh = ctx.sh
        u, n, n_kv = sh.u, sh.n, sh.n_kv
        send = dq.new_empty(u, sh.s, sh.b, n + 2 * n_kv, sh.d)
        for x, heads in ((dq, slice(0, n)), (dk, slice(n, n + n_kv)), (dv, slice(n + n_kv, n + 2 * n_kv))):
            send[:, :, :, heads].copy_(x.view(u, sh.s, *x.shape[1:]))
        recv = sh.exchange(send)  # [U (my heads of member m), s, b, ·, d]
        grads = [recv[..., :n, :].permute(1, 2, 0, 3, 4).reshape(sh.s, sh.b, sh.h, sh.d)]
        for j in range(2):
            part = recv[..., n + j * n_kv:n + (j + 1) * n_kv, :].permute(1, 2, 0, 3, 4)
            part = part.reshape(sh.s, sh.b, u * n_kv, sh.d)
            if not sh.kv_all:  # replicated heads: the members' parts add up
                part = dq.new_zeros(sh.s, sh.b, sh.g, sh.d).index_add_(2, sh.kv_index, part)
            grads.append(part)
        return None, *grads


class _ToSequence(torch.autograd.Function):
    """The output back: head-sharded [U·s, b, n, d] → sequence-sharded [s, b, h, d]."""

    @staticmethod
    def forward(ctx, sh: _Shape, o):
        ctx.sh = sh
        send = o.reshape(sh.u, sh.s, sh.b, sh.n, sh.d)
        return sh.exchange(send).permute(1, 2, 0, 3, 4).reshape(sh.s, sh.b, sh.h, sh.d)

    @staticmethod
    def backward(ctx, do):
        sh = ctx.sh
        return None, sh.rows(sh.exchange(_by_member(do, sh.u).contiguous()))


def ulysses_wallfacer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, ulysses_size: int,
                      inner: Callable) -> torch.Tensor:
    """All-to-all to head shards inside the Ulysses group, ``inner(q', k', v', outer_group)`` (WallFacer
    over the P/U groups on the rows :func:`outer_shards` describes, autograd included), all-to-all back.
    Inputs and output as wallfacer_attention: [s, b, h, d] queries, [s, b, g, d] K/V, this rank's rows;
    the checks have run."""
    hg = hybrid_groups(group, ulysses_size)
    sh = _Shape(hg, q, k)
    qh, kh, vh = _ToHeads.apply(sh, q, k, v)
    return _ToSequence.apply(sh, inner(qh, kh, vh, hg.outer))
