"""wallfacer_attention: exact attention over a sequence sharded across a group, with teams and sub-rings.

WallFacer / StarTrail (arXiv 2407.00611; wallfacer.md §3 forward, §4 backward). Teams of C ranks
all-gather Q, K, V; each rank sends its team's K/V once to its place (paper Alg. 2); C² concentric
sub-rings of length G = P/C² then circulate K/V (Alg. 1, 3) while every rank attends its team's
queries to the K/V passing by, merging block results by their log-sum-exp; a team reduce-scatter
combines the C partial results (each over 1/C of the keys) and hands every rank its own rows.
C = 1 is ring attention; C = √P has no ring loop.

Shape legend: s local rows, b batch, h query heads, g K/V heads, d head dim, C team size; "team"
tensors hold the team's C·s rows sorted by chunk id (layout.py), so causal blocks are prefixes.
"""

from __future__ import annotations

import math

import torch

from commweave import comm
from megatron_patches import block
from megatron_patches.checks import BACKWARDS, check_inputs, default_scale
from megatron_patches.groups import WallFacerGroups, wallfacer_groups
from megatron_patches.layout import Layout, causal_calls
from megatron_patches.team import gather_team, reduce_team
from megatron_patches.volume import Shard, choose_backward


def wallfacer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, team_size: int,
                        causal: bool = True, softmax_scale: float | None = None, layout: str = "zigzag",
                        *, order=None, kernel: str = "auto", backward: str = "auto",
                        check: bool = True, deterministic: bool = False) -> torch.Tensor:
    """Softmax attention of the whole sequence, sharded over ``group``; returns this rank's rows.

    Args:
        q: ``[s_local, b, h, d]``, this rank's queries, as Megatron-core hands them to core
            attention (RoPE already applied).
        k, v: ``[s_local, b, g, d]`` with the *un-expanded* K/V heads (g divides h; query head j
            reads K/V head j // (h/g), GQA/MQA). They travel un-expanded.
        group: the context-parallel process group of P ranks.
        team_size: C, with C² dividing P. 1 is ring attention.
        causal: causal mask over global positions.
        softmax_scale: defaults to 1/sqrt(d).
        layout: which tokens a rank holds: "zigzag" (Megatron's ``get_batch_on_this_cp_rank``:
            chunks r and 2P−1−r of 2P) or "contiguous" (chunks 2r, 2r+1). P·s_local must divide
            by 2P.
        order: slot → group rank permutation from placement.py (default: identity).
        kernel: per-block kernel, one of block.KERNELS (or a kernel object, block.py).
        backward: "kv" (K/V and their gradients circulate), "q" (queries, dO, O and dQ circulate,
            as in the paper) or "auto" (the one with fewer bytes, volume.choose_backward).
        check: all-gather a few integers of metadata first so that bad or mismatched inputs raise
            the same ValueError on every rank (checks.py).
        deterministic: bitwise reproducible gradients (flash-attn's deterministic backward,
            block.py); Megatron's ``deterministic_mode``.

    Returns:
        ``[s_local, b, h, d]`` in q's dtype. Online-softmax state and gradient accumulators are
        fp32 (fp64 for fp64 inputs); fp16, bf16, fp32 and fp64 inputs are supported.
    """
    if check:
        check_inputs(q, k, v, group, team_size, causal, softmax_scale, layout, backward=backward,
                     kernel=kernel, order=order, deterministic=deterministic)
    if backward not in BACKWARDS:  # with check=False
        raise ValueError(f"backward={backward!r} is not one of {BACKWARDS}")
    lay = Layout(comm.size(group), team_size, tuple(order or ()), layout)
    groups = wallfacer_groups(group, lay)
    sh = Shard(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.element_size(),
               block.acc_dtype(q.dtype).itemsize)
    mode = choose_backward(lay, sh) if backward == "auto" else backward
    scale = default_scale(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    kern = block.select_kernel(kernel, q.device, q.dtype, deterministic, head_dim=q.shape[3])
    run = _Run(groups, kern, scale, bool(causal), mode)
    return _WallFacer.apply(q, k, v, run)


class _Run:
    """What one call needs besides tensors: groups, kernel, scale, mask, backward variant."""

    def __init__(self, groups: WallFacerGroups, kernel, scale: float, causal: bool, mode: str) -> None:
        self.groups, self.kernel, self.scale, self.causal, self.mode = groups, kernel, scale, causal, mode
        lay = groups.layout
        self.lay, self.me = lay, groups.rank
        self.chunks = {t: lay.sorted_team_chunks(t) for t in range(lay.teams)}

    def calls(self, q_team: int, kv_team: int) -> list[tuple[int, int, int, bool]]:
        if not self.causal:
            n = 2 * self.lay.team_size
            return [(0, n, n, False)]
        return causal_calls(self.chunks[q_team], self.chunks[kv_team])

    def empty(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer that is dead when this forward or backward returns, kept for the next call on CPU.

        CPU torch has no caching allocator: glibc gives large freed blocks back to the kernel, so a
        call would page-fault its multi-MB accumulators and receive buffers in again each time (about
        4k faults per step at P = 8, C = 2, ~4% of a rank's CPU). CUDA's caching allocator already
        reuses memory, so there this allocates. One flat buffer per name and layout, grown to the largest
        request: the forward and the backward use the same names for buffers of the same role (they
        never live at once). Outputs and tensors saved for the backward are never such buffers.
        """
        if device.type != "cpu":
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

    def pieces(self, team: int, first: int, stop: int, half: int) -> list[tuple[slice, slice, int, slice]]:
        """Where a result over the team's sorted chunks [first, stop) goes in an all-gather-order
        accumulator [C, s, ...]: (rows of the result, sorted team rows, member, that member's rows)."""
        return [(slice((j - first) * half, (j - first + n) * half), slice(j * half, (j + n) * half),
                 member, slice(h * half, (h + n) * half))
                for j, member, h, n in self.lay.wire_runs(team, first, stop)]


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] memory seen as [b, h, s, d] (a view: kernels take strided inputs)."""
    return t.permute(1, 2, 0, 3)


def _by_member(team: torch.Tensor, c: int) -> tuple[int, ...]:
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


def _attend(run: _Run, q_team: int, q, kv, kv_team: int, o, lse) -> None:
    """Team queries ``q`` [b,h,C·s,d] against one team's K/V ``kv`` [2, C·s, b, g, d] (rows sorted),
    merged into ``o`` [C, s, b, h, d] (all-gather order) and ``lse`` [b, h, C·s] (sorted)."""
    half = q.shape[2] // (2 * run.lay.team_size)
    k, v = _bhsd(kv[0]), _bhsd(kv[1])
    for q0, q1, kn, diag in run.calls(q_team, kv_team):
        rows, keys = slice(q0 * half, q1 * half), slice(0, kn * half)
        o_b, lse_b = run.kernel.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], run.scale, diag)
        for res, srt, member, wire in run.pieces(q_team, q0, q1, half):
            _merge(_bhsd(o[member, wire]), lse[:, :, srt], o_b[:, :, res], lse_b[:, :, res])


def _attend_backward(run: _Run, q_team: int, qdo, lse, kv, kv_team: int, dq, dkv) -> None:
    """Gradients of one block, added into the all-gather-order accumulators dq [C, s, b, h, d] and
    dkv [C, 2, s, b, g, d].

    ``qdo`` holds the team's q, dO and final O, each [C·s, b, h, d] (stacked or not), rows sorted.
    """
    half = qdo[0].shape[0] // (2 * run.lay.team_size)
    q, do, o = _bhsd(qdo[0]), _bhsd(qdo[1]), _bhsd(qdo[2])
    k, v = _bhsd(kv[0]), _bhsd(kv[1])
    for q0, q1, kn, diag in run.calls(q_team, kv_team):
        rows, keys = slice(q0 * half, q1 * half), slice(0, kn * half)
        dq_b, dk_b, dv_b = run.kernel.backward(do[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                               o[:, :, rows], lse[:, :, rows], run.scale, diag)
        for res, _, member, wire in run.pieces(q_team, q0, q1, half):
            _bhsd(dq[member, wire]).add_(dq_b[:, :, res])
        for res, _, member, wire in run.pieces(kv_team, 0, kn, half):
            _bhsd(dkv[member, 0, wire]).add_(dk_b[:, :, res])
            _bhsd(dkv[member, 1, wire]).add_(dv_b[:, :, res])


class _WallFacer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        g, lay, me = run.groups, run.lay, run.me
        c, G, acc = lay.team_size, lay.ring_len, block.acc_dtype(q.dtype)
        # Phase 1: team all-gather (one collective for q, k, v), rows sorted by chunk.
        # Team K/V that is placed elsewhere is dead after the ring; q_t, and K/V that stays, are saved.
        placing = lay.place_target(me) != me
        buffers = run.gather_buffers({"wire": "wire", 1: "team"} if placing else {"wire": "wire"})
        (q_t,), kv = gather_team(g, [q], [k, v], empty=buffers)  # kv: [2, C·s, b, g, d]
        # Phase 1b: the initial placement (Alg. 2); queries stay.
        kv0 = torch.empty_like(kv) if placing else kv
        works = g.permute(kv, lay.place_target(me), kv0, lay.place_source(me), tag=0) if placing else []
        # Phase 2: G ring steps, the next K/V in flight while this one is attended (double buffer: G − 1
        # receives into at most two buffers; the team's K/V buffer is free for one once placed, kv0 is
        # kept for the backward).
        o = run.empty("acc", _by_member(q_t, c), acc, q.device).zero_()
        lse = torch.full((q.shape[1], q.shape[2], q_t.shape[0]), float("-inf"), dtype=acc, device=q.device)
        bufs = ([kv] if placing else [])[:G - 1]
        bufs += [run.empty(f"kv{j}", kv.shape, kv.dtype, kv.device) for j in range(min(2, G - 1) - len(bufs))]
        cur, qb = kv0, _bhsd(q_t)
        for i in range(G):
            for w in works:
                w.wait()
            nxt = bufs[i % 2] if i + 1 < G else None
            works = g.ring_shift([cur], [nxt], tag=0) if nxt is not None else []
            _attend(run, g.my_team, qb, cur, lay.kv_team(me, i), o, lse)
            cur = nxt if nxt is not None else cur
        # Phase 3: combine the C partial results: lse_f = logsumexp over the team, O_c·e^(lse_c − lse_f),
        # reduce-scatter.
        lse_f = lse
        if c > 1:
            lse_all = torch.empty((c, *lse.shape), dtype=acc, device=lse.device)
            comm.all_gather(lse_all, lse, g.team)
            lse_f = torch.logsumexp(lse_all, dim=0)
            weight = torch.exp(lse - lse_f).unsqueeze(-1)
            for _, srt, member, wire in run.pieces(g.my_team, 0, 2 * c, q.shape[0] // 2):
                _bhsd(o[member, wire]).mul_(weight[:, :, srt])
        (out,) = reduce_team(g, [o], q.dtype)
        ctx.run = run
        ctx.save_for_backward(q_t, kv0, lse_f, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        run = ctx.run
        q_t, kv0, lse, out = ctx.saved_tensors
        if run.lay.team_size == 1:
            do_t, o_t = dout, out
        else:
            buffers = run.gather_buffers({"wire": "wire", 0: "team"})
            do_t, o_t = gather_team(run.groups, [dout, out], empty=buffers)[0]
        if run.mode == "kv":
            dq, dkv = _backward_kv(run, (q_t, do_t, o_t), lse, kv0)
        else:
            qdo = torch.stack((q_t, do_t, o_t))  # one message per hop
            del do_t, o_t
            dq, dkv = _backward_q(run, qdo, lse, kv0)
        dq_l, dkv_l = reduce_team(run.groups, [dq, dkv], q_t.dtype)
        return dq_l, dkv_l[0], dkv_l[1], None


def _dkv_shape(kv0: torch.Tensor, c: int) -> tuple[int, ...]:
    """All-gather-order dK/dV accumulator of a [2, C·s, b, g, d] K/V: [C, 2, s, b, g, d]."""
    return (c, 2, kv0.shape[1] // c, *kv0.shape[2:])


class _Relay:
    """A gradient that hops along the sub-ring once per step, each rank adding its contribution
    (dK/dV travelling with the K/V, or dQ with the queries), then a last hop to its owner.

    Step i accumulates into a fresh zeroed buffer while step i−1's sum is still being sent and the
    predecessor's sum is arriving; after the wait the arrived buffer is added and both are free
    again. So at most three buffers live (a pool), and the final hop lands in a recycled one.
    """

    def __init__(self, run: _Run, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
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

    def result(self) -> torch.Tensor:
        """What the last hop delivered to this rank."""
        for w in self._works:
            w.wait()
        return self._arriving


def _backward_kv(run: _Run, qdo, lse, kv0):
    """K/V and their gradients circulate; queries, dO, O and dQ stay (ring-flash-attention's scheme).

    After G steps a rank holds the dK/dV of the K/V that ring_next placed; the last hop sends them
    straight to the rank that placed that K/V (the inverse of Alg. 2), saving the hop home.
    """
    g, lay, me = run.groups, run.lay, run.me
    acc, G, c = lse.dtype, lay.ring_len, lay.team_size
    dq = run.empty("acc", _by_member(qdo[0], c), acc, kv0.device).zero_()
    kv_bufs = [run.empty(f"kv{j}", kv0.shape, kv0.dtype, kv0.device) for j in range(min(2, G - 1))]
    relay = _Relay(run, "dkv", _dkv_shape(kv0, c), acc, kv0.device)
    home, home_src = lay.place_source(lay.ring_next(me)), lay.ring_prev(lay.place_target(me))
    kv_works, cur = [], kv0
    for i in range(G):
        for w in kv_works:
            w.wait()
        nxt = kv_bufs[i % 2] if i + 1 < G else None
        kv_works = g.ring_shift([cur], [nxt], tag=0) if nxt is not None else []
        blk = relay.begin()
        _attend_backward(run, g.my_team, qdo, lse, cur, lay.kv_team(me, i), dq, blk)
        if i + 1 < G:
            relay.pass_on(blk, lambda x, r: g.ring_shift([x], [r], tag=1))
        else:
            relay.pass_on(blk, lambda x, r: g.permute(x, home, r, home_src, tag=1))
        cur = nxt if nxt is not None else cur
    return dq, relay.result()


def _backward_q(run: _Run, qdo, lse, kv0):
    """The paper's backward: each team's (q, dO, O, lse) and its dQ travel; dK/dV stay, then go home.

    With G > 1 the dQ makes G hops: G − 1 with its queries, then the one back to its own team.
    """
    g, lay, me = run.groups, run.lay, run.me
    acc, G, c = lse.dtype, lay.ring_len, lay.team_size
    dkv = run.empty("acc", _dkv_shape(kv0, c), acc, kv0.device).zero_()
    b_bufs = [(run.empty(f"qdo{j}", qdo.shape, qdo.dtype, qdo.device),
               run.empty(f"lse{j}", lse.shape, lse.dtype, lse.device)) for j in range(min(2, G - 1))]
    relay = _Relay(run, "dq", _by_member(qdo[0], c), acc, qdo.device)
    b_works, cur, blk = [], (qdo, lse), None
    for i in range(G):
        for w in b_works:
            w.wait()
        nxt = b_bufs[i % 2] if i + 1 < G else None
        b_works = g.ring_shift(list(cur), list(nxt), tag=0) if nxt is not None else []
        blk = relay.begin()
        _attend_backward(run, lay.q_team_at(me, i), cur[0], cur[1], kv0, lay.kv_team(me, 0), blk, dkv)
        if G > 1:
            relay.pass_on(blk, lambda x, r: g.ring_shift([x], [r], tag=1))
        cur = nxt if nxt is not None else cur
    dkv_home = run.empty("dkv home", dkv.shape, acc, kv0.device)
    works = g.permute(dkv, lay.place_source(me), dkv_home, lay.place_target(me), tag=2)
    dq = relay.result() if G > 1 else blk
    for w in works:
        w.wait()
    return dq, dkv_home
