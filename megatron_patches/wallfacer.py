"""wallfacer_attention: exact attention over a sequence sharded across a group, with teams and sub-rings.

WallFacer / StarTrail (arXiv 2407.00611; wallfacer.md §3 forward, §4 backward). Teams of C ranks
all-gather Q, K, V; each rank sends its team's K/V once to its place (paper Alg. 2); C² concentric
sub-rings of length G = P/C² then circulate K/V (Alg. 1, 3) while every rank attends its team's
queries to the K/V passing by, merging block results by their log-sum-exp; a team reduce-scatter
combines the C partial results (each over 1/C of the keys) and hands every rank its own rows.
C = 1 is ring attention; C = √P has no ring loop.

Shape legend: s local rows, b batch, h query heads, g K/V heads, d head dim, C team size; "team"
tensors hold the team's C·s rows sorted by stream position (rowmap.py), so every document's rows are
contiguous and causal blocks are prefixes of them. Packed (THD) batches: packing.py.
"""

from __future__ import annotations

import functools

import torch

from commweave import comm
from megatron_patches import block, hybrid, packing
from megatron_patches.backward import backward_kv, backward_q, row_dot
from megatron_patches.checks import BACKWARDS, check_inputs, default_scale
from megatron_patches.groups import wallfacer_groups
from megatron_patches.layout import LAYOUTS, Layout, team_size_error
from megatron_patches.steps import Run, attend, bhsd, by_member
from megatron_patches.team import gather_team, reduce_team
from megatron_patches.volume import Shard, choose_backward

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
                        deterministic: bool = False, packed_seq_params=None, positions=None) -> torch.Tensor:
    """Softmax attention of the whole sequence, sharded over ``group``; returns this rank's rows.

    Args:
        q: ``[s_local, b, h, d]``, this rank's queries, as Megatron-core hands them to core
            attention (RoPE already applied).
        k, v: ``[s_local, b, g, d]`` with the *un-expanded* K/V heads (g divides h; query head j
            reads K/V head j // (h/g), GQA/MQA). They travel un-expanded.
        group: the context-parallel process group of P ranks.
        team_size: C, with C² dividing P. 1 is ring attention.
        causal: causal mask over global positions (a bool: strings and numbers are refused).
        softmax_scale: defaults to 1/sqrt(d).
        layout: which tokens a rank holds: "zigzag" (Megatron's ``get_batch_on_this_cp_rank``:
            chunks r and 2P−1−r of 2P; packed, the same per document, packing.py) or "contiguous"
            (chunks 2r, 2r+1: positions [r·s, (r+1)·s)). Dense, P·s_local must divide by 2P.
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
            the same ValueError on every rank (checks.py for shapes, dtypes, C, causal, layout,
            scale, the backward variant, the order, the packing and the positions;
            :func:`check_settings` for U and team_qkv).
        deterministic: bitwise reproducible gradients (flash-attn's deterministic backward,
            block.py); Megatron's ``deterministic_mode``.
        packed_seq_params: Megatron's ``PackedSeqParams`` for a packed (THD) batch: ``qkv_format="thd"``,
            the global ``cu_seqlens_q`` (= ``cu_seqlens_kv``) and optionally ``cu_seqlens_q_padded``;
            every document attends only itself (causally if ``causal``). This rank's rows are its rows of
            the stream in ``layout`` (packing.py; ``packing.get_packed_batch_on_this_cp_rank`` shards a
            batch so), s_local = ⌈T/P⌉ for a stream of T tokens; any batch size b (the same packing).
        positions: this rank's position ids ``[s_local]`` or ``[b, s_local]``, when the caller has them:
            checked against what ``layout`` puts on this rank (stream positions, or positions inside each
            document for packed batches), so that a batch sharded in another layout raises instead of
            giving a wrong result. Padding rows may hold anything.

    Returns:
        ``[s_local, b, h, d]`` in q's dtype. Online-softmax state and gradient accumulators are
        fp32 (fp64 for fp64 inputs); fp16, bf16, fp32 and fp64 inputs are supported. Padding rows of a
        packed batch get 0.
    """
    world = comm.size(group)
    bad_u = ulysses_size_error(ulysses_size, world)
    pack, pack_error = _packing(packed_seq_params)
    shards = packing.shards(pack, layout, world) if layout in LAYOUTS and pack is not None else None
    if check or not isinstance(check, bool):  # the same two all-gathers on every rank, whatever U it was
        # given (the order permutes the P/U groups when U > 1: the inner call uses it, so it is compared
        # here only for U = 1)
        local = (bad_u or pack_error or _check_error(check)
                 or _positions_error(positions, pack, shards, layout, group, q))
        check_inputs(q, k, v, group, team_size, causal, softmax_scale, layout, backward=backward,
                     kernel=kernel, order=order if ulysses_size == 1 else None, deterministic=deterministic,
                     error=local, packing=pack)
        check_settings(group, ulysses_size, team_size, team_qkv, q.shape[2], k.shape[2])
    elif bad_u or pack_error:
        raise ValueError(bad_u or pack_error)
    if backward not in BACKWARDS:  # with check=False
        raise ValueError(f"backward={backward!r} is not one of {BACKWARDS}")
    scale = default_scale(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    kern = block.select_kernel(kernel, q.device, q.dtype, deterministic, head_dim=q.shape[3])
    if shards is None:  # dense: the layout's two chunks per rank, sized by q
        shards = packing.shards(packing.dense(world * q.shape[0]), layout, world)
    args = (team_size, bool(causal), scale, layout, tuple(order or ()), kern, backward, team_qkv)
    if ulysses_size > 1:
        return hybrid.ulysses_wallfacer(q, k, v, group, ulysses_size, functools.partial(
            _attention, args=args, shards=hybrid.outer_shards(shards, ulysses_size)))
    return _attention(q, k, v, group, args=args, shards=shards)


def _attention(q, k, v, group, *, args, shards) -> torch.Tensor:
    """WallFacer over ``group`` (the CP group, or the hybrid's outer group), the checks done; ``shards``:
    every group rank's runs (packing.py)."""
    team_size, causal, scale, layout, order, kern, backward, team_qkv = args
    if comm.size(group) == 1 and len(shards[0]) == 1:  # one dense sequence in order: one kernel call each way
        return _Local.apply(q, k, v, kern, scale, causal)
    lay = Layout(comm.size(group), team_size, order, layout)
    groups = wallfacer_groups(group, lay)
    sh = Shard(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.element_size(),
               block.acc_dtype(q.dtype).itemsize)
    mode = choose_backward(lay, sh) if backward == "auto" else backward
    keep = resolve_team_qkv(team_qkv, team_size) == "keep"
    run = Run(groups, kern, scale, causal, mode, keep, shards=shards)
    return _WallFacer.apply(q, k, v, run)


def ulysses_size_error(ulysses_size, world: int) -> str | None:
    """Why ``ulysses_size`` is not an integer U in 1 … P, judged by this rank alone, or None (the hybrid's
    other rules need every rank's head counts: check_settings)."""
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or not 1 <= ulysses_size <= world:
        return f"ulysses_size={ulysses_size!r} must be an int in 1 … P = {world} (the context-parallel ranks)"
    return None


def _check_error(check) -> str | None:
    return None if isinstance(check, bool) else f"check={check!r} must be a bool"


def _packing(params):
    """(Packing or None, this rank's refusal of ``params`` or None)."""
    if params is None:
        return None, None
    try:
        return packing.from_packed_seq_params(params), None
    except ValueError as e:
        return None, f"packed_seq_params: {e}"


def _positions_error(positions, pack, shards, layout: str, group, q) -> str | None:
    """positions_error for this rank, the dense shards made from q's rows when the batch is not packed."""
    if positions is None or layout not in LAYOUTS or not isinstance(q, torch.Tensor) or q.dim() != 4:
        return None
    world = comm.size(group)
    if shards is None:
        if (world * q.shape[0]) % (2 * world):
            return None  # check_inputs refuses the length
        shards = packing.shards(packing.dense(world * q.shape[0]), layout, world)
    return positions_error(positions, pack, shards, layout, comm.rank(group))


def positions_error(positions, pack, shards, layout: str, rank: int) -> str | None:
    """Why ``positions`` are not what ``layout`` puts on group rank ``rank``, or None (see the docstring of
    wallfacer_attention). Only this rank's rows are compared: a cheap local check."""
    if positions is None:
        return None
    if (not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2)
            or positions.is_floating_point()):
        return f"positions must be an integer tensor [s_local] or [b, s_local], got {_describe(positions)}"
    got = positions.reshape(-1, positions.shape[-1]).cpu()
    s = sum(n for _, n, _ in shards[rank])
    if got.shape[1] != s:
        return f"positions hold {got.shape[1]} rows, the {layout} layout gives this rank {s}"
    pack = pack or packing.dense(s * len(shards))
    for reset in (False, True):
        want = torch.tensor(packing.rank_positions(pack, shards[rank], reset))
        real = want >= 0
        if bool((got[:, real] == want[real]).all()):
            return None
    want = packing.rank_positions(pack, shards[rank], pack.docs > 1)
    other = [name for name in LAYOUTS if name != layout and _matches(got, pack, name, len(shards), rank)]
    hint = f": the batch is in the {other[0]} layout; pass layout={other[0]!r}" if other else ""
    return (f"positions {got[0, :8].tolist()}{'...' if s > 8 else ''} on this rank are not the {layout} "
            f"layout's {want[:8]}{'...' if s > 8 else ''}{hint}")


def _matches(got, pack, layout: str, world: int, rank: int) -> bool:
    runs = packing.shards(pack, layout, world)[rank]
    for reset in (False, True):
        want = torch.tensor(packing.rank_positions(pack, runs, reset))
        if want.numel() == got.shape[1] and bool((got[:, want >= 0] == want[want >= 0]).all()):
            return True
    return False


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-d {str(x.dtype).replace('torch.', '')} tensor"
    return type(x).__name__


def check_settings(group, ulysses_size: int, team_size: int, team_qkv: str, heads: int,
                   kv_heads: int) -> None:
    """Raise the same ValueError on every rank of ``group`` when the ranks disagree on the settings
    that decide which collectives run and that checks.check_inputs does not compare (U and team_qkv: a
    rank running ring attention while the others enter the hybrid's all-to-all would hang them), naming
    each one and every rank's value (comm.check_agree: one all-gather of 3 int64 per rank); then, all
    agreeing, when U and C break the hybrid's rules (decided alike everywhere, no further traffic).
    The shapes (so the heads), C, the backward variant, causal, layout and scale were agreed by
    checks.check_inputs.
    """
    codes = f"team_qkv {dict(enumerate(TEAM_QKV))}, -1 unknown"
    comm.check_agree(group, f"wallfacer_attention (codes: {codes})", ulysses_size=ulysses_size,
                     team_qkv=TEAM_QKV.index(team_qkv) if team_qkv in TEAM_QKV else -1)
    if team_qkv not in TEAM_QKV:  # every rank passed the same unknown value
        raise ValueError(f"wallfacer_attention: team_qkv={team_qkv!r} is not one of {TEAM_QKV}")
    world, u = comm.size(group), ulysses_size
    if u > 1:
        error = hybrid.ulysses_error(world, u, heads, kv_heads)
        if error is None and team_size_error(world // u, team_size):
            error = f"{team_size_error(world // u, team_size)} (WallFacer runs over P/U = {world // u} " \
                    f"groups)"
        if error:
            raise ValueError(f"wallfacer_attention: {error}")


class _WallFacer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run: Run):
        run.bind(q.shape[0])
        g, lay, me = run.groups, run.lay, run.me
        c, G, acc = lay.team_size, lay.ring_len, block.acc_dtype(q.dtype)
        # Phase 1 + 1b: team all-gather (one collective for q, k, v, rows sorted by chunk), then the
        # initial placement (Alg. 2; queries stay). Kept for the backward ("keep") or rebuilt there.
        (q_t,), kv, kv0, works = _team_qkv(run, [q], [k, v], saved=run.keep)
        placing = kv0 is not kv
        # Phase 2: G ring steps, the next K/V in flight while this one is attended (double buffer: G − 1
        # receives into at most two buffers; the team's K/V buffer is free for one once placed).
        o = run.empty("acc", by_member(q_t, c), acc, q.device)
        lse = torch.full((q.shape[1], q.shape[2], q_t.shape[0]), float("-inf"), dtype=acc, device=q.device)
        # Rows no block reaches (padding) keep O = 0, lse = −inf; when step 0 reaches all (always with
        # C = 1 on a dense sequence: the rank's own diagonal block), its blocks are copied in rather than
        # merged into zeros.
        rows = run.rows(g.my_team).rows
        covered = sum(q1 - q0 for q0, q1, *_ in run.calls(g.my_team, lay.kv_team(me, 0))) == rows
        if not covered:
            o.zero_()
        bufs = ([kv] if placing else [])[:G - 1]
        bufs += [run.empty(f"kv{j}", kv.shape, kv.dtype, kv.device) for j in range(min(2, G - 1) - len(bufs))]
        cur, qb = kv0, bhsd(q_t)
        for i in range(G):
            for w in works:
                w.wait()
            nxt = bufs[i % 2] if i + 1 < G else None
            works = g.ring_shift([cur], [nxt], tag=0) if nxt is not None else []
            attend(run, g.my_team, qb, cur, lay.kv_team(me, i), o, lse, first=i == 0 and covered)
            cur = nxt if nxt is not None else cur
        # Phase 3: combine the C partial results: lse_f = logsumexp over the team, O_c·e^(lse_c − lse_f),
        # reduce-scatter. Padding rows have lse_f = −inf (and O = 0 on every member): weight 0, not NaN.
        lse_f = lse
        if c > 1:
            lse_all = torch.empty((c, *lse.shape), dtype=acc, device=lse.device)
            comm.all_gather(lse_all, lse, g.team)
            lse_f = torch.logsumexp(lse_all, dim=0)
            weight = torch.exp(lse - lse_f).nan_to_num_(0.0).unsqueeze(-1)
            for _, srt, member, wire in run.pieces(g.my_team, 0, rows):
                bhsd(o[member, wire]).mul_(weight[:, :, srt])
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
        delta = row_dot(dout, out, lse.dtype)
        d_bytes = delta.view(dout.dtype)
        if run.keep:
            q_t, kv0 = inputs
            buffers = run.gather_buffers({"wire": "wire", 0: "team do", 1: "team D"})
            do_t, d_t = gather_team(run.groups, run.rows(run.groups.my_team), [dout], [d_bytes],
                                    empty=buffers)
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
            # C = 1 with rows in order: the team's O is this rank's own output, no stand-in needed.
            own = run.lay.team_size == 1 and run.rows(run.groups.my_team).identity
            dq, dkv = backward_kv(run, qd, d_t, lse, kv0, out if own else None)
        else:
            ld = torch.stack((lse, d_t.permute(1, 2, 0)))  # one message per hop: [2, b, h, C·s]
            dq, dkv = backward_q(run, qd, ld, kv0)
        dq_l, dkv_l = reduce_team(run.groups, [dq, dkv], dout.dtype)
        return dq_l, dkv_l[0], dkv_l[1], None


class _Local(torch.autograd.Function):
    """P = 1 with the rows in order (a dense sequence): attention of this rank's whole sequence, no team or
    ring; the block kernel's forward and backward once each, [s, b, ·, d] in and out."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale: float, causal: bool):
        o, lse = kernel.forward(bhsd(q), bhsd(k), bhsd(v), scale, causal)
        out = o.permute(2, 0, 1, 3).to(q.dtype)
        ctx.args = kernel, scale, causal
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, scale, causal = ctx.args
        q, k, v, out, lse = ctx.saved_tensors
        grads = kernel.backward(bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse, scale, causal)
        dq, dk, dv = (g.permute(2, 0, 1, 3).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, None, None, None


def _team_qkv(run: Run, qs: list, kvs: list, saved: bool, extra: list = ()):
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
    q_t, kv, *rest = gather_team(g, run.rows(g.my_team), *stacks, empty=run.gather_buffers(names))
    if not placing:
        return (q_t, kv, kv, [], *rest)
    kv0 = torch.empty_like(kv) if saved else run.empty("kv placed", kv.shape, kv.dtype, kv.device)
    works = g.permute(kv, lay.place_target(me), kv0, lay.place_source(me), tag=0)
    return (q_t, kv, kv0, works, *rest)


