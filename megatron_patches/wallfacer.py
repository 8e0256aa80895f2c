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
from megatron_patches import block, hybrid
from megatron_patches.checks import check_inputs, default_scale
from megatron_patches.groups import WallFacerGroups, cached_groups, wallfacer_groups
from megatron_patches.layout import LAYOUTS, Layout, causal_calls
from megatron_patches.team import gather_team, reduce_team
from megatron_patches.volume import Shard, choose_backward

BACKWARDS = ("auto", "kv", "q")
TEAM_QKV = ("auto", "keep", "rebuild")


def resolve_team_qkv(team_qkv: str, team_size: int, recomputed: bool = False) -> str:
    """``auto``: rebuild the team's Q/K/V in the backward when C > 1 (the paper's memory, eq. 6), unless
    the caller recomputes the whole layer anyway (Megatron's full recompute: the kept tensors then live
    only during that layer's backward, so rebuilding would cost the gather for no memory). C = 1 holds
    the same bytes either way, so it keeps."""
    if team_qkv not in TEAM_QKV:
        raise ValueError(f"team_qkv={team_qkv!r} is not one of {TEAM_QKV}")
    if team_qkv != "auto":
        return team_qkv
    return "rebuild" if team_size > 1 and not recomputed else "keep"


def wallfacer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, team_size: int,
                        causal: bool = True, softmax_scale: float | None = None, layout: str = "zigzag",
                        *, order=None, kernel: str = "auto", backward: str = "auto",
                        team_qkv: str = "auto", ulysses_size: int = 1, check: bool = True,
                        deterministic: bool = False) -> torch.Tensor:
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
        backward: "kv" (K/V and their gradients circulate), "q" (queries, dO, the row sums
            D = rowsum(dO∘O) and dQ circulate, as in the paper) or "auto" (the one with fewer bytes,
            volume.choose_backward).
        team_qkv: "keep" the team's Q and placed K/V from the forward for the backward (3C·A per
            layer, MHA), "rebuild" them there with the same all-gather and placement (holds this
            rank's q, k, v: 3A, as ring attention; the team's 3C·A then exist only while one layer's
            backward runs, paper §3.2.2 eq. 6), or "auto" (resolve_team_qkv: rebuild when C > 1).
        ulysses_size: U > 1 runs the Ulysses x WallFacer hybrid (hybrid.py): a head all-to-all
            inside groups of U consecutive ranks, then WallFacer with team size C (C² dividing P/U)
            over the P/U groups, on U·s rows and h/U heads. U must divide P and h; g must be a
            multiple of U or divide it. ``order`` then permutes the P/U groups.
        check: all-gather a few integers of metadata first so that bad or mismatched inputs raise
            the same ValueError on every rank (checks.py; hybrid.check_hybrid for U and C).
        deterministic: bitwise reproducible gradients (flash-attn's deterministic backward,
            block.py); Megatron's ``deterministic_mode``.

    Returns:
        ``[s_local, b, h, d]`` in q's dtype. Online-softmax state and gradient accumulators are
        fp32 (fp64 for fp64 inputs); fp16, bf16, fp32 and fp64 inputs are supported.
    """
    if backward not in BACKWARDS:
        raise ValueError(f"backward={backward!r} is not one of {BACKWARDS}")
    keep = resolve_team_qkv(team_qkv, team_size) == "keep"
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1:
        raise ValueError(f"ulysses_size={ulysses_size!r} must be an int >= 1")
    if ulysses_size > 1:
        if check:
            check_inputs(q, k, v, group, 1, causal, softmax_scale, layout)
            hybrid.check_hybrid(group, ulysses_size, team_size, LAYOUTS.index(layout), q.shape[2], k.shape[2])

        def inner(qh, kh, vh, outer):
            return wallfacer_attention(qh, kh, vh, outer, team_size, causal, softmax_scale, layout,
                                       order=order, kernel=kernel, backward=backward, team_qkv=team_qkv,
                                       check=False, deterministic=deterministic)

        return hybrid.ulysses_wallfacer(q, k, v, group, ulysses_size, layout, inner)
    if check:
        check_inputs(q, k, v, group, team_size, causal, softmax_scale, layout)
    scale = default_scale(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    kern = block.select_kernel(kernel, q.device, q.dtype, deterministic, head_dim=q.shape[3])
    if comm.size(group) == 1:  # the whole sequence, in order (either layout): one kernel call each way
        return _Local.apply(q, k, v, kern, scale, bool(causal))
    lay = Layout(comm.size(group), team_size, tuple(order or ()), layout)
    groups = wallfacer_groups(group, lay)
    sh = Shard(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.element_size(),
               block.acc_dtype(q.dtype).itemsize)
    mode = choose_backward(lay, sh) if backward == "auto" else backward
    run = _Run(groups, kern, scale, bool(causal), mode, keep)
    return _WallFacer.apply(q, k, v, run)


_KEEP_CPU_BUFFERS = [True]


def keep_cpu_buffers(enabled: bool) -> None:
    """Whether CPU calls keep their dead buffers for the next call (the default, _Run.empty) or allocate
    and free them as CUDA calls do (what a caching allocator's peak sees; benchmarks.attention)."""
    _KEEP_CPU_BUFFERS[0] = bool(enabled)
    if not enabled:
        release_buffers()


def kept_buffer_bytes() -> int:
    """Bytes of the CPU buffers kept between calls (_Run.empty), over every cached layout of this process."""
    return sum(t.numel() * t.element_size() for g in cached_groups() for t in g.scratch.values())


def release_buffers() -> None:
    """Free the CPU buffers kept between calls; the next call allocates them again."""
    for g in cached_groups():
        g.scratch.clear()


class _Run:
    """What one call needs besides tensors: groups, kernel, scale, mask, backward variant, and whether
    the team's Q/K/V are kept for the backward."""

    def __init__(self, groups: WallFacerGroups, kernel, scale: float, causal: bool, mode: str,
                 keep: bool = True) -> None:
        self.groups, self.kernel, self.scale, self.causal, self.mode = groups, kernel, scale, causal, mode
        self.keep = keep
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


def _attend(run: _Run, q_team: int, q, kv, kv_team: int, o, lse, first: bool = False) -> None:
    """Team queries ``q`` [b,h,C·s,d] against one team's K/V ``kv`` [2, C·s, b, g, d] (rows sorted),
    merged into ``o`` [C, s, b, h, d] (all-gather order) and ``lse`` [b, h, C·s] (sorted).
    ``first``: the calls cover every row and nothing was merged yet, so the blocks are copied."""
    half = q.shape[2] // (2 * run.lay.team_size)
    k, v = _bhsd(kv[0]), _bhsd(kv[1])
    for q0, q1, kn, diag in run.calls(q_team, kv_team):
        rows, keys = slice(q0 * half, q1 * half), slice(0, kn * half)
        o_b, lse_b = run.kernel.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], run.scale, diag)
        for res, srt, member, wire in run.pieces(q_team, q0, q1, half):
            if first:
                _bhsd(o[member, wire]).copy_(o_b[:, :, res])
                lse[:, :, srt].copy_(lse_b[:, :, res])
            else:
                _merge(_bhsd(o[member, wire]), lse[:, :, srt], o_b[:, :, res], lse_b[:, :, res])


def _attend_backward(run: _Run, q_team: int, qd, o, lse, kv, kv_team: int, dq, dkv) -> None:
    """Gradients of one block, added into the all-gather-order accumulators dq [C, s, b, h, d] and
    dkv [C, 2, s, b, g, d].

    ``qd`` holds the team's q and dO, ``o`` an O' with the team's D = rowsum(dO∘O) (_o_for_delta),
    each [C·s, b, h, d], rows sorted.
    """
    half = qd[0].shape[0] // (2 * run.lay.team_size)
    q, do, o = _bhsd(qd[0]), _bhsd(qd[1]), _bhsd(o)
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
        # Phase 1 + 1b: team all-gather (one collective for q, k, v, rows sorted by chunk), then the
        # initial placement (Alg. 2; queries stay). Kept for the backward ("keep") or rebuilt there.
        (q_t,), kv, kv0, works = _team_qkv(run, [q], [k, v], saved=run.keep)
        placing = kv0 is not kv
        # Phase 2: G ring steps, the next K/V in flight while this one is attended (double buffer: G − 1
        # receives into at most two buffers; the team's K/V buffer is free for one once placed).
        o = run.empty("acc", _by_member(q_t, c), acc, q.device)
        lse = torch.full((q.shape[1], q.shape[2], q_t.shape[0]), float("-inf"), dtype=acc, device=q.device)
        # Rows no block reaches keep O = 0, lse = −inf; when step 0 reaches all (always with C = 1: the
        # rank's own diagonal block), its blocks are copied in rather than merged into zeros.
        covered = sum(q1 - q0 for q0, q1, _, _ in run.calls(g.my_team, lay.kv_team(me, 0))) == 2 * c
        if not covered:
            o.zero_()
        bufs = ([kv] if placing else [])[:G - 1]
        bufs += [run.empty(f"kv{j}", kv.shape, kv.dtype, kv.device) for j in range(min(2, G - 1) - len(bufs))]
        cur, qb = kv0, _bhsd(q_t)
        for i in range(G):
            for w in works:
                w.wait()
            nxt = bufs[i % 2] if i + 1 < G else None
            works = g.ring_shift([cur], [nxt], tag=0) if nxt is not None else []
            _attend(run, g.my_team, qb, cur, lay.kv_team(me, i), o, lse, first=i == 0 and covered)
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
        # Memory (paper §3.2.2): "keep" holds the team's Q and placed K/V, 3C·A per layer (MHA) until
        # the backward; "rebuild" holds this rank's own q, k, v (3A, what ring attention holds) and
        # pays the team's 3C·A again only while this layer's backward runs, i.e. once, at the peak
        # (eq. 6: PM = M + (Y + 3C + 1)·A against ring attention's M + (Y + 4)·A).
        ctx.save_for_backward(*((q_t, kv0) if run.keep else (q, k, v)), lse_f, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        run = ctx.run
        *inputs, lse, out = ctx.saved_tensors
        # D = rowsum(dO∘O) is all the kernels need of O (block.py): the team gathers D (b·h·s floats per
        # rank) instead of O; the fp32 D travels in the wire's dtype as raw bytes.
        delta = _row_dot(dout, out, lse.dtype)
        d_bytes = delta.view(dout.dtype)
        if run.keep:
            q_t, kv0 = inputs
            do_t, d_t = gather_team(run.groups, [dout], [d_bytes], empty=run.gather_buffers(
                {"wire": "wire", 0: "team do", 1: "team D"}))
            # One message per hop in "q"; in "kv" the queries stay, so no stacked copy.
            qd = torch.stack((q_t, do_t[0])) if run.mode == "q" else (q_t, do_t[0])
            works, kv_t = [], None
            del do_t
        else:
            qd, kv_t, kv0, works, d_t = _team_qkv(run, [inputs[0], dout], [inputs[1], inputs[2]], saved=False,
                                                  extra=[d_bytes])
        d_t = d_t[0].view(lse.dtype)  # [C·s, b, h], rows sorted like the team tensors
        for w in works:  # the rebuilt placement
            w.wait()
        del kv_t  # placed: only kv0 is needed now (the same tensor on ranks that keep their own)
        if run.mode == "kv":
            # C = 1: the team's O is this rank's own output, no stand-in needed.
            dq, dkv = _backward_kv(run, qd, d_t, lse, kv0, out if run.lay.team_size == 1 else None)
        else:
            ld = torch.stack((lse, d_t.permute(1, 2, 0)))  # one message per hop: [2, b, h, C·s]
            dq, dkv = _backward_q(run, qd, ld, kv0)
        dq_l, dkv_l = reduce_team(run.groups, [dq, dkv], dout.dtype)
        return dq_l, dkv_l[0], dkv_l[1], None


class _Local(torch.autograd.Function):
    """P = 1 (Ulysses alone, U = P, in hybrid.py): attention of this rank's whole sequence, no team or
    ring; the block kernel's forward and backward once each, [s, b, ·, d] in and out."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale: float, causal: bool):
        o, lse = kernel.forward(_bhsd(q), _bhsd(k), _bhsd(v), scale, causal)
        out = o.permute(2, 0, 1, 3).to(q.dtype)
        ctx.args = kernel, scale, causal
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, scale, causal = ctx.args
        q, k, v, out, lse = ctx.saved_tensors
        grads = kernel.backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, scale, causal)
        dq, dk, dv = (g.permute(2, 0, 1, 3).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, None, None, None


def _team_qkv(run: _Run, qs: list, kvs: list, saved: bool, extra: list = ()):
    """Gather ``qs`` and ``kvs`` (and ``extra``) in the team, rows sorted, then post the placement of
    the K/V stack (Alg. 2). Returns (team qs [L, C·s, ...], team K/V, placed K/V, placement works[,
    team extra]); the placed K/V *is* the team K/V on ranks that keep their own. ``saved``: the
    team Q and placed K/V outlive the call (kept for the backward), so they are not scratch buffers.
    """
    g, lay, me = run.groups, run.lay, run.me
    placing = lay.place_target(me) != me
    names = {"wire": "wire", 0: "team q", 2: "team extra"}
    if placing or not saved:
        names[1] = "team kv"  # dead once placed, or rebuilt in the backward
    if saved:
        del names[0]
    stacks = [qs, kvs, list(extra)] if extra else [qs, kvs]
    q_t, kv, *rest = gather_team(g, *stacks, empty=run.gather_buffers(names))
    if not placing:
        return (q_t, kv, kv, [], *rest)
    kv0 = torch.empty_like(kv) if saved else run.empty("kv placed", kv.shape, kv.dtype, kv.device)
    works = g.permute(kv, lay.place_target(me), kv0, lay.place_source(me), tag=0)
    return (q_t, kv, kv0, works, *rest)


def _row_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """rowsum(a∘b) over the head dim, in ``acc``: [s, b, h, d] × 2 → [s, b, h], contiguous."""
    return torch.linalg.vecdot(a.to(acc), b.to(acc))


def _o_for_delta(do: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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


def _backward_kv(run: _Run, qd, delta, lse, kv0, o=None):
    """K/V and their gradients circulate; queries, dO, D and dQ stay (ring-flash-attention's scheme).

    After G steps a rank holds the dK/dV of the K/V that ring_next placed; the last hop sends them
    straight to the rank that placed that K/V (the inverse of Alg. 2), saving the hop home; a rank that
    placed that K/V itself keeps them. ``o``: the team's O if at hand, else a stand-in from D.
    """
    g, lay, me = run.groups, run.lay, run.me
    acc, G, c = lse.dtype, lay.ring_len, lay.team_size
    if o is None:
        o = _o_for_delta(qd[1], delta, run.empty("o", qd[1].shape, qd[1].dtype, qd[1].device))
    dq = run.empty("acc", _by_member(qd[0], c), acc, kv0.device).zero_()
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
        _attend_backward(run, g.my_team, qd, o, lse, cur, lay.kv_team(me, i), dq, blk)
        if i + 1 < G:
            relay.pass_on(blk, lambda x, r: g.ring_shift([x], [r], tag=1))
        elif home == me:
            return dq, relay.keep(blk)
        else:
            relay.pass_on(blk, lambda x, r: g.permute(x, home, r, home_src, tag=1))
        cur = nxt if nxt is not None else cur
    return dq, relay.result()


def _backward_q(run: _Run, qd, ld, kv0):
    """The paper's backward: each team's (q, dO) and (lse, D) and its dQ travel; dK/dV stay, then go
    home. D = rowsum(dO∘O) replaces O on the wire: per hop 2·A_q + 2 rows instead of 3·A_q + 1 row.

    With G > 1 the dQ makes G hops: G − 1 with its queries, then the one back to its own team.
    """
    g, lay, me = run.groups, run.lay, run.me
    acc, G, c = ld.dtype, lay.ring_len, lay.team_size
    dkv = run.empty("acc", _dkv_shape(kv0, c), acc, kv0.device).zero_()
    b_bufs = [(run.empty(f"qd{j}", qd.shape, qd.dtype, qd.device),
               run.empty(f"ld{j}", ld.shape, ld.dtype, ld.device)) for j in range(min(2, G - 1))]
    o = run.empty("o", qd[1].shape, qd.dtype, qd.device)
    relay = _Relay(run, "dq", _by_member(qd[0], c), acc, qd.device)
    b_works, cur, blk = [], (qd, ld), None
    for i in range(G):
        for w in b_works:
            w.wait()
        nxt = b_bufs[i % 2] if i + 1 < G else None
        b_works = g.ring_shift(list(cur), list(nxt), tag=0) if nxt is not None else []
        blk = relay.begin()
        _o_for_delta(cur[0][1], cur[1][1].permute(2, 0, 1), o)
        _attend_backward(run, lay.q_team_at(me, i), cur[0], o, cur[1][0], kv0, lay.kv_team(me, 0), blk, dkv)
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
