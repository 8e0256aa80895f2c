"""wallfacer_attention on gloo worlds: exact against single-process full attention, ledger bytes equal to
volume.py's formulas, and bad input raising the same ValueError on every rank before any traffic.

Every case function builds the same global tensors on every rank (same seed), runs the reference on
the whole sequence and WallFacer on this rank's zigzag (or contiguous) rows, and returns the max
errors; one world call runs many cases, so the worlds are started once per size.
"""

import random

import pytest
import torch
import torch.distributed as dist

from commweave import ledger
from megatron_patches.groups import RING, TEAM
from megatron_patches.layout import Layout, rank_chunks, valid_team_sizes
from megatron_patches.placement import hop_messages, ring_major
from megatron_patches.volume import Shard, backward_bytes, forward_bytes, mean_p2p
from megatron_patches.wallfacer import wallfacer_attention

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp64": 1e-10, "fp32": 2e-5}


def full_attention(q, k, v, scale, causal):
    """Softmax attention over the whole sequence: q [N, b, h, d], k/v [N, b, g, d] (head j → j // (h/g))."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(s, -1), v)


def local_rows(layout, world, rank, s_local):
    half = s_local // 2
    return torch.cat([torch.arange(c * half, (c + 1) * half) for c in rank_chunks(layout, world, rank)])


def _global_inputs(n, b, hq, hkv, d):
    torch.manual_seed(1234)
    q, do = torch.randn(n, b, hq, d, dtype=torch.float64), torch.randn(n, b, hq, d, dtype=torch.float64)
    k, v = torch.randn(n, b, hkv, d, dtype=torch.float64), torch.randn(n, b, hkv, d, dtype=torch.float64)
    return q, k, v, do


def _reference(q, k, v, do, causal, dtype=torch.float64):
    """Full attention and its input gradients, computed in ``dtype``."""
    inputs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = full_attention(*inputs, q.shape[3] ** -0.5, causal)
    out.backward(do.to(dtype))
    return [out] + [t.grad for t in inputs]


def _run_case(world, c, causal, hq, hkv, mode, kernel, dtype, team_qkv="auto", layout="zigzag", order=None,
              s_local=4, b=2, d=8):
    q, k, v, do = _global_inputs(world * s_local, b, hq, hkv, d)
    want = _reference(q, k, v, do, causal)
    rows = local_rows(layout, world, dist.get_rank(), s_local)
    mine = [t[rows].to(DTYPES[dtype]).requires_grad_() for t in (q, k, v)]
    out = wallfacer_attention(*mine, dist.group.WORLD, c, causal=causal, layout=layout, order=order,
                              kernel=kernel, backward=mode, team_qkv=team_qkv)
    out.backward(do[rows].to(out.dtype))
    got = [out] + [t.grad for t in mine]
    return [(g.double() - w[rows]).abs().max().item() for g, w in zip(got, want, strict=True)]


def _numerics(cases):
    return {case: _run_case(dist.get_world_size(), *case) for case in cases}


def _cases(world):
    cases = []
    for c in valid_team_sizes(world):
        for causal in (True, False):
            for hq, hkv in ((4, 4), (4, 2), (4, 1)):
                team_qkv = "keep" if hkv == 2 else "rebuild"  # both for every (C, causal, mode)
                for mode in ("kv", "q"):
                    cases.append((c, causal, hq, hkv, mode, "sdpa", "fp64", team_qkv))
            cases.append((c, causal, 4, 2, "auto", "reference", "fp64"))
            cases.append((c, causal, 4, 2, "auto", "sdpa", "fp32"))
            cases.append((c, causal, 4, 2, "kv", "sdpa", "fp64", "keep", "contiguous"))
    c = max(valid_team_sizes(world))
    perm = list(range(world))
    random.Random(world).shuffle(perm)
    cases.append((c, True, 4, 2, "q", "sdpa", "fp64", "rebuild", "zigzag", tuple(perm)))
    cases.append((c, True, 4, 2, "kv", "sdpa", "fp64", "auto", "zigzag", ring_major(world, c)))
    return cases


def _check_numerics(world):
    results = world.run(_numerics, _cases(world.world_size))
    bad = {}
    for case in results[0]:
        err = max(max(r[case]) for r in results)
        if err > TOL[case[6]]:
            bad[case] = err
    assert not bad, f"cases over tolerance (C, causal, hq, hkv, mode, kernel, dtype, team_qkv, ...): {bad}"


@pytest.mark.world_size(4)
def test_exact_against_full_attention_p4(world):
    _check_numerics(world)


@pytest.mark.world_size(8)
def test_exact_against_full_attention_p8(world):
    _check_numerics(world)


@pytest.mark.big_world
@pytest.mark.world_size(16)
def test_exact_against_full_attention_p16(world):
    _check_numerics(world)


def _low_precision_case(mode, dtype):
    """16-bit WallFacer vs fp64, next to single-process attention in the same dtype vs fp64 (flash-attn's
    error rule). The team reduce-scatters carry the 16-bit dtype; accumulators are fp32."""
    world = dist.get_world_size()
    c = max(valid_team_sizes(world))
    wallfacer = _run_case(world, c, True, 4, 2, mode, "auto", dtype, s_local=8, d=16)
    q, k, v, do = _global_inputs(world * 8, 2, 4, 2, 16)
    rows = local_rows("zigzag", world, dist.get_rank(), 8)
    exact, low = _reference(q, k, v, do, True), _reference(q, k, v, do, True, DTYPES[dtype])
    single = [(lo.double() - ex)[rows].abs().max().item() for lo, ex in zip(low, exact, strict=True)]
    return wallfacer, single


@pytest.mark.world_size(4)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["kv", "q"])
def test_16_bit_within_twice_single_process_error(world, mode, dtype):
    for wallfacer, single in world.run(_low_precision_case, mode, dtype):
        for name, w, s in zip(("out", "dq", "dk", "dv"), wallfacer, single, strict=True):
            assert w <= 2 * s, f"{name}: WallFacer {dtype} error {w:.3g} > 2 x single-process error {s:.3g}"


def _ledger_case(c, mode, dtype, hq=4, hkv=2, s_local=4, b=2, d=8):
    """Forward and backward ledgers with the team Q/K/V kept and rebuilt."""
    torch.manual_seed(dist.get_rank())
    mine = [torch.randn(s_local, b, h, d, dtype=DTYPES[dtype], requires_grad=True) for h in (hq, hkv, hkv)]
    out = {}
    for team_qkv in ("keep", "rebuild"):
        with ledger.recording() as fwd:
            o = wallfacer_attention(*mine, dist.group.WORLD, c, backward=mode, team_qkv=team_qkv)
        with ledger.recording() as bwd:
            o.backward(torch.ones_like(o))
        out[team_qkv] = fwd.as_dict(), bwd.as_dict()
    return out


LEDGER_NAMES = {TEAM: "team", RING: "ring", "world": "cp"}


def _as_counts(led: dict, names: dict = LEDGER_NAMES) -> dict:
    """Ledger dict → {(kind, "team"|"ring"|"cp"): sent bytes}, only the kinds that sent something."""
    out = {}
    for key, entry in led.items():
        kind, group = key.split("@")
        if entry["sent"]:
            out[kind, names[group]] = out.get((kind, names[group]), 0) + entry["sent"]
    return out


@pytest.mark.world_size(8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["kv", "q"])
@pytest.mark.parametrize("c", [1, 2])
def test_ledger_bytes_equal_formulas(world, c, mode, dtype):
    per_rank = world.run(_ledger_case, c, mode, dtype)
    lay = Layout(8, c)
    elt = DTYPES[dtype].itemsize
    sh = Shard(4, 2, 4, 2, 8, elt, 4)
    for r, both in enumerate(per_rank):
        for team_qkv, (fwd, bwd) in both.items():
            want = backward_bytes(lay, sh, r, mode, rebuild=team_qkv == "rebuild")
            assert _as_counts(fwd) == dict(forward_bytes(lay, sh, r)), f"rank {r} forward, {team_qkv}"
            assert _as_counts(bwd) == dict(want), f"rank {r} backward, {team_qkv}"
            # the sub-ring messages the cost model prices, one α each (placement.estimate): G − 1 forward
            # hops of one; G − 1 backward hops of hop_messages, and with "q" the dQ's hop to its team
            g = lay.ring_len
            assert fwd[f"send@{RING}"]["calls"] == g - 1
            assert bwd[f"send@{RING}"]["calls"] == (g - 1) * hop_messages(mode) + (mode == "q")


@pytest.mark.world_size(8)
def test_p2p_is_half_of_ring_attention_at_p8_c2(world):
    """P = C³ (G = C): the placement keeps K/V on exactly P/C² ranks, so the mean is exactly 1/C."""
    means = {}
    for c in (1, 2):
        per_rank = world.run(_ledger_case, c, "kv", "fp32")
        means[c] = sum(_as_counts(f).get(("send", "ring"), 0) + _as_counts(f).get(("send", "cp"), 0)
                       for f, _ in (r["keep"] for r in per_rank)) / 8
    assert means[2] * 2 == means[1]
    assert means[1] == mean_p2p(Layout(8, 1), Shard(4, 2, 4, 2, 8, 4, 4))


def _reuse_case(c, mode):
    """Two calls in a row on other data (the next layer): the first call's output and gradients must be
    unchanged afterwards, i.e. none of the buffers kept between calls (Run.empty) was handed out."""
    first = None
    for seed in (0, 1):
        torch.manual_seed(seed * 100 + dist.get_rank())
        q, k, v = (torch.randn(4, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        out = wallfacer_attention(q, k, v, dist.group.WORLD, c, backward=mode)
        out.backward(torch.randn_like(out))
        got = [out.detach(), q.grad, k.grad, v.grad]
        first = first or (got, [t.clone() for t in got])
    return max((a - b).abs().max().item() for a, b in zip(*first, strict=True))


@pytest.mark.world_size(8)
@pytest.mark.parametrize("mode", ["kv", "q"])
def test_results_do_not_alias_buffers_kept_between_calls(world, mode):
    for c in (1, 2):
        assert max(world.run(_reuse_case, c, mode)) == 0.0, f"C={c}"


def _saved_case(c, s_local=4, b=2, hq=4, hkv=2, d=8):
    """Bytes the attention saves for its backward (every tensor autograd packs), per team_qkv."""
    torch.manual_seed(dist.get_rank())
    out = {}
    for team_qkv in ("keep", "rebuild"):
        mine = [torch.randn(s_local, b, h, d).requires_grad_() for h in (hq, hkv, hkv)]
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = wallfacer_attention(*mine, dist.group.WORLD, c, team_qkv=team_qkv)
        o.backward(torch.ones_like(o))
        out[team_qkv] = sum(saved)
    return out


@pytest.mark.world_size(4)
def test_rebuild_saves_what_ring_attention_saves(world):
    """Per layer (paper §3.2.2): kept, the team's Q and placed K/V, C·A_q + 2C·A_kv; rebuilt, this rank's
    q, k, v, A_q + 2·A_kv — as ring attention; both also save O and the team's lse (fp32)."""
    c, s, b, hq, hkv, d = 2, 4, 2, 4, 2, 8
    a_q, a_kv, lse = s * b * hq * d * 4, s * b * hkv * d * 4, c * s * b * hq * 4
    for saved in world.run(_saved_case, c):
        assert saved["keep"] == c * a_q + 2 * c * a_kv + a_q + lse
        assert saved["rebuild"] == a_q + 2 * a_kv + a_q + lse


def _bad(kind):
    """Break one rule (on every rank or on one) and return the ValueError text, or None."""
    me, world = dist.get_rank(), dist.get_world_size()
    s, c, hq, hkv, dtype = 4, 2, 4, 2, torch.float32
    if kind == "odd_sequence":
        s = 3
    elif kind == "team_size":
        c = 3
    elif kind == "heads":
        hq, hkv = 3, 2
    elif kind == "shape_on_one_rank" and me == 1:
        s = 6
    elif kind == "odd_on_one_rank" and me == 3:
        s = 5
    elif kind == "dtype_on_one_rank" and me == 2:
        dtype = torch.bfloat16
    q = torch.randn(s, 2, hq, 8, dtype=dtype)
    k = v = torch.randn(s, 2, hkv, 8, dtype=dtype)
    if kind == "kv_shapes":
        v = torch.randn(s, 2, hkv, 4, dtype=dtype)
    with ledger.recording() as led:
        try:
            wallfacer_attention(q, k, v, dist.group.WORLD, c)
        except ValueError as e:
            # The only traffic before the error is the metadata all-gather.
            assert set(led.as_dict()) == {"all_gather@world"}, led.as_dict()
            return str(e)
    return f"no error on rank {me} of {world}"


BAD = {
    "odd_sequence": "sequence length 12 (= P·s_local = 4·3) must be divisible by 2·P = 8",
    "team_size": "team_size C=3 is invalid for P=4 ranks: C² must divide P (valid: 1, 2)",
    "heads": "q has 3 heads and k/v have 2",
    "shape_on_one_rank": "ranks disagree: rank 1 passes q [6, 2, 4, 8] float32",
    "odd_on_one_rank": "rank 3: sequence length 20 (= P·s_local = 4·5) must be divisible by 2·P = 8",
    "dtype_on_one_rank": "ranks disagree: rank 2 passes q [4, 2, 4, 8] bfloat16",
    "kv_shapes": "k and v must have the same shape",
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_raises_same_error_on_every_rank(world, kind):
    messages = world.run(_bad, kind)
    assert len(set(messages)) == 1, messages
    assert BAD[kind] in messages[0], messages[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_o_for_delta_carries_the_row_sums(dtype):
    """The O' handed to the block kernels in place of O has rowsum(dO∘O') = D, also for rows with dO = 0,
    to one rounding of O' relative to D, and stays as small as O (no fp16 overflow)."""
    from megatron_patches.backward import o_for_delta

    torch.manual_seed(0)
    do, o = torch.randn(6, 2, 3, 16, dtype=torch.float64), 100 * torch.randn(6, 2, 3, 16, dtype=torch.float64)
    do[2, 1, 0] = 0.0
    do, o = do.to(dtype), o.to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    delta = (do.to(acc) * o.to(acc)).sum(-1)
    got = o_for_delta(do, delta, torch.empty_like(do))
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert got[2, 1, 0].abs().max() == 0
    assert (got.double().norm(dim=-1) <= o.double().norm(dim=-1) * (1 + 1e-2)).all()
    kernel_delta = (do.double() * got.double()).sum(-1)
    rel = (kernel_delta - delta.double()).abs() / delta.double().abs().clamp_min(1e-30)
    assert rel.max() <= {torch.float64: 1e-14, torch.float32: 1e-6}.get(dtype, 2 * torch.finfo(dtype).eps)
