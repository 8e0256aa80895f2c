"""WallFacer's backward, two ways (wallfacer.md §4): K/V and their gradients circulate ("kv",
ring-flash-attention's scheme) or the queries, dO, lse, D and dQ do (the paper's "q"); the row sums
D = rowsum(dO∘O) stand in for O (``o_for_delta``).

Shape legend as in wallfacer.py and steps.py.
"""

from __future__ import annotations

import torch

from megatron_patches.steps import Run, attend_backward, by_member, dkv_shape


def row_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """rowsum(a∘b) over the head dim, in ``acc``: [s, b, h, d] × 2 → [s, b, h], contiguous."""
    return torch.linalg.vecdot(a.to(acc), b.to(acc))


def o_for_delta(do: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` (dO's shape [..., d] and dtype) an O' with rowsum(dO∘O') = D (``delta`` [...]).

    The block kernels (flash-attn's and ATen's backward, block.py) take O, not D, and read it only
    through D = rowsum(dO∘O) (FlashAttention-2 Alg. 2). O' = dO·D/|dO|² (rows with dO = 0 have D = 0
    and get O' = 0) makes every term dO_i·O'_i of the kernel's sum the same sign, so its D is exact up
    to O''s rounding (relative to D, no cancellation), and |O'| ≤ |O| (Cauchy-Schwarz): no overflow
    where O had none.
    """
    d = do.to(delta.dtype)
    norm = torch.linalg.vecdot(d, d)
    scale = torch.where(norm > 0, delta / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0)
    return torch.mul(d, scale.unsqueeze(-1), out=out)


class Relay:
    """A gradient that hops along the sub-ring once per step, each rank adding its contribution
    (dK/dV travelling with the K/V, or dQ with the queries), then a last hop to its owner.

    Step i accumulates into a fresh zeroed buffer while step i−1's sum is still being sent and the
    predecessor's sum is arriving; after the wait the arrived buffer is added and both are free
    again. So at most three buffers live (a pool), and the final hop lands in a recycled one.
    """

    def __init__(self, run: Run, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self._new = lambda n: run.empty(f"{name}{n}", shape, dtype, device)
        self._free, self._made = [], 0
        self._works, self._sent, self._arriving = [], None, None

    def _take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        self._made += 1
        return self._new(self._made)

    def begin(self) -> torch.Tensor:
        """The zeroed accumulator of this step's contributions."""
        return self._take().zero_()

    def pass_on(self, blk: torch.Tensor, hop) -> None:
        """Add the predecessor's sum into ``blk`` and post ``hop(blk, recv) -> works``."""
        for w in self._works:
            w.wait()
        if self._arriving is not None:
            blk += self._arriving
            self._free += [self._sent, self._arriving]
        recv = self._take()
        self._works, self._sent, self._arriving = hop(blk, recv), blk, recv

    def keep(self, blk: torch.Tensor) -> torch.Tensor:
        """Instead of a last hop: add the predecessor's sum into ``blk``, which stays on this rank."""
        for w in self._works:
            w.wait()
        if self._arriving is not None:
            blk += self._arriving
        return blk

    def result(self) -> torch.Tensor:
        """What the last hop delivered to this rank."""
        for w in self._works:
            w.wait()
        return self._arriving


def backward_kv(run: Run, qd, delta, lse, kv0, o=None):
    """K/V and their gradients circulate; queries, dO, D and dQ stay (ring-flash-attention's scheme).

    After G steps a rank holds the dK/dV of the K/V that ring_next placed; the last hop sends them
    straight to the rank that placed that K/V (the inverse of Alg. 2), saving the hop home; a rank that
    placed that K/V itself keeps them. ``o``: the team's O if at hand, else a stand-in from D.
    """
    g, lay, me = run.groups, run.lay, run.me
    acc, G, c = lse.dtype, lay.ring_len, lay.team_size
    if o is None:
        o = o_for_delta(qd[1], delta, run.empty("o", qd[1].shape, qd[1].dtype, qd[1].device))
    dq = run.empty("acc", by_member(qd[0], c), acc, kv0.device).zero_()
    kv_bufs = [run.empty(f"kv{j}", kv0.shape, kv0.dtype, kv0.device) for j in range(min(2, G - 1))]
    relay = Relay(run, "dkv", dkv_shape(kv0, c), acc, kv0.device)
    home, home_src = lay.place_source(lay.ring_next(me)), lay.ring_prev(lay.place_target(me))
    kv_works, cur = [], kv0
    for i in range(G):
        for w in kv_works:
            w.wait()
        nxt = kv_bufs[i % 2] if i + 1 < G else None
        kv_works = g.ring_shift([cur], [nxt], tag=0) if nxt is not None else []
        blk = relay.begin()
        attend_backward(run, g.my_team, qd, o, lse, cur, lay.kv_team(me, i), dq, blk)
        if i + 1 < G:
            relay.pass_on(blk, lambda x, r: g.ring_shift([x], [r], tag=1))
        elif home == me:
            return dq, relay.keep(blk)
        else:
            relay.pass_on(blk, lambda x, r: g.permute(x, home, r, home_src, tag=1))
        cur = nxt if nxt is not None else cur
    return dq, relay.result()


def backward_q(run: Run, qd, ld, kv0):
    """The paper's backward: each team's (q, dO) and (lse, D) and its dQ travel; dK/dV stay, then go
    home. D = rowsum(dO∘O) replaces O on the wire: per hop 2·A_q + 2 rows instead of 3·A_q + 1 row.

    With G > 1 the dQ makes G hops: G − 1 with its queries, then the one back to its own team.
    """
    g, lay, me = run.groups, run.lay, run.me
    acc, G, c = ld.dtype, lay.ring_len, lay.team_size
    dkv = run.empty("acc", dkv_shape(kv0, c), acc, kv0.device).zero_()
    b_bufs = [(run.empty(f"qd{j}", qd.shape, qd.dtype, qd.device),
               run.empty(f"ld{j}", ld.shape, ld.dtype, ld.device)) for j in range(min(2, G - 1))]
    o = run.empty("o", qd[1].shape, qd.dtype, qd.device)
    relay = Relay(run, "dq", by_member(qd[0], c), acc, qd.device)
    b_works, cur, blk = [], (qd, ld), None
    for i in range(G):
        for w in b_works:
            w.wait()
        nxt = b_bufs[i % 2] if i + 1 < G else None
        b_works = g.ring_shift(list(cur), list(nxt), tag=0) if nxt is not None else []
        blk = relay.begin()
        o_for_delta(cur[0][1], cur[1][1].permute(2, 0, 1), o)
        attend_backward(run, lay.q_team_at(me, i), cur[0], o, cur[1][0], kv0, lay.kv_team(me, 0), blk, dkv)
        if G > 1:
            relay.pass_on(blk, lambda x, r: g.ring_shift([x], [r], tag=1))
        cur = nxt if nxt is not None else cur
    if lay.place_source(me) == me:  # the K/V this rank holds are its own team's
        return (relay.result() if G > 1 else blk), dkv
    dkv_home = run.empty("dkv home", dkv.shape, acc, kv0.device)
    works = g.permute(dkv, lay.place_source(me), dkv_home, lay.place_target(me), tag=2)
    dq = relay.result() if G > 1 else blk
    for w in works:
        w.wait()
    return dq, dkv_home
