"""Ulysses x WallFacer (hybrid.py) on an 8-rank gloo world: exact against single-process full attention
(fp64, forward and the three input gradients), GQA without expanded K/V (replicated K/V heads where
U > g), its ledger equal to volume.hybrid_bytes, and bad U refused on every rank before any traffic."""

import re

import pytest
import torch
import torch.distributed as dist

from commweave import ledger
from megatron_patches import packing
from megatron_patches.hybrid import OUTER, ULYSSES, kv_heads_of, outer_shards, ulysses_error
from megatron_patches.layout import Layout
from megatron_patches.volume import Shard, hybrid_bytes
from megatron_patches.wallfacer import wallfacer_attention
from tests.megatron_patches.test_wallfacer import (
    DTYPES,
    LEDGER_NAMES,
    _as_counts,
    _global_inputs,
    _reference,
    local_rows,
)

# (U, C, causal, hq, hkv, backward, team_qkv, layout): the (2, 2), (4, 1), (2, 1), and U = P
# (Ulysses alone); MHA, GQA and MQA (K/V heads replicated to U/g members when g < U).
CASES = [(u, c, causal, 8, hkv, mode, team_qkv, "zigzag")
         for u, c in ((2, 2), (4, 1), (2, 1), (8, 1))
         for causal in (True, False)
         for hkv, mode, team_qkv in ((8, "q", "keep"), (2, "kv", "rebuild"), (1, "q", "rebuild"))]
CASES += [(2, 2, True, 8, 4, "kv", "auto", "contiguous"), (4, 1, True, 8, 2, "auto", "auto", "contiguous")]


def _case(u, c, causal, hq, hkv, mode, team_qkv, layout, dtype="fp64", s_local=4, b=2, d=8):
    world = dist.get_world_size()
    q, k, v, do = _global_inputs(world * s_local, b, hq, hkv, d)
    want = _reference(q, k, v, do, causal)
    rows = local_rows(layout, world, dist.get_rank(), s_local)
    mine = [t[rows].to(DTYPES[dtype]).requires_grad_() for t in (q, k, v)]
    out = wallfacer_attention(*mine, dist.group.WORLD, c, causal=causal, layout=layout, backward=mode,
                              team_qkv=team_qkv, ulysses_size=u)
    out.backward(do[rows].to(out.dtype))
    got = [out] + [t.grad for t in mine]
    return [(g.double() - w[rows]).abs().max().item() for g, w in zip(got, want, strict=True)]


def _numerics(cases):
    return {case: _case(*case) for case in cases}


@pytest.mark.world_size(8)
def test_exact_against_full_attention_p8(world):
    results = world.run(_numerics, CASES)
    bad = {case: err for case in CASES if (err := max(max(r[case]) for r in results)) > 1e-10}
    assert not bad, f"over 1e-10 (U, C, causal, hq, hkv, backward, team_qkv, layout): {bad}"


def _low_precision(cases, dtype="bf16"):
    """16-bit hybrid vs fp64, next to single-process attention in the same dtype vs fp64."""
    world = dist.get_world_size()
    q, k, v, do = _global_inputs(world * 8, 2, 8, 2, 16)
    rows = local_rows("zigzag", world, dist.get_rank(), 8)
    exact, low = _reference(q, k, v, do, True), _reference(q, k, v, do, True, DTYPES[dtype])
    single = [(lo.double() - ex)[rows].abs().max().item() for lo, ex in zip(low, exact, strict=True)]
    return {(u, c): (_case(u, c, True, 8, 2, "auto", "auto", "zigzag", dtype, s_local=8, d=16), single)
            for u, c in cases}


@pytest.mark.world_size(8)
def test_bf16_within_twice_single_process_error(world):
    for per_case in world.run(_low_precision, [(8, 1), (2, 2), (4, 1)]):
        for (u, c), (hybrid, single) in per_case.items():
            for name, h, s in zip(("out", "dq", "dk", "dv"), hybrid, single, strict=True):
                assert h <= 2 * s, f"U={u} C={c} {name}: bf16 error {h:.3g} > 2 x single-process {s:.3g}"


def _ledger_cases(cases, hq=8, hkv=2, s_local=4, b=2, d=8):
    """Forward and backward ledgers of each (U, C, backward, team_qkv, dtype)."""
    out = {}
    for u, c, mode, team_qkv, dtype in cases:
        torch.manual_seed(dist.get_rank())
        mine = [torch.randn(s_local, b, h, d, dtype=DTYPES[dtype]).requires_grad_() for h in (hq, hkv, hkv)]
        with ledger.recording() as fwd:
            o = wallfacer_attention(*mine, dist.group.WORLD, c, backward=mode, team_qkv=team_qkv,
                                    ulysses_size=u)
        with ledger.recording() as bwd:
            o.backward(torch.ones_like(o))
        out[u, c, mode, team_qkv, dtype] = fwd.as_dict(), bwd.as_dict()
    return out


NAMES = {**LEDGER_NAMES, ULYSSES: "ulysses", OUTER: "outer"}


LEDGER_CASES = [(2, 2, "q", "rebuild", "bf16"), (2, 2, "kv", "keep", "fp32"), (4, 1, "kv", "keep", "fp32"),
                (2, 1, "q", "keep", "bf16"), (8, 1, "kv", "keep", "fp32")]


@pytest.mark.world_size(8)
def test_ledger_bytes_equal_formula(world):
    per_rank = world.run(_ledger_cases, LEDGER_CASES)
    for (u, c, mode, team_qkv, dtype) in LEDGER_CASES:
        lay = Layout(8 // u, c)
        sh = Shard(4, 2, 8, 2, 8, DTYPES[dtype].itemsize, 4)
        for r, ledgers in enumerate(per_rank):
            fwd, bwd = ledgers[u, c, mode, team_qkv, dtype]
            want_fwd, want_bwd = hybrid_bytes(8, u, lay, sh, r, mode, rebuild=team_qkv == "rebuild")
            where = f"U={u} C={c} {mode} {team_qkv} {dtype}: rank {r}"
            assert _as_counts(fwd, NAMES) == dict(want_fwd), f"{where} forward"
            assert _as_counts(bwd, NAMES) == dict(want_bwd), f"{where} backward"


def _bad(kind):
    me = dist.get_rank()
    u, c, hq, hkv = 2, 2, 8, 2
    if kind == "u_not_dividing_p":
        u = 3
    elif kind == "heads":
        hq, hkv = 6, 6
        u = 4
    elif kind == "kv_heads":
        hq, hkv, u = 12, 6, 4
    elif kind == "team_size":
        u, c = 4, 2
    elif kind == "u_on_one_rank":
        u, c = (4 if me == 5 else 2), 1
    q = torch.randn(4, 2, hq, 8)
    k = v = torch.randn(4, 2, hkv, 8)
    with ledger.recording() as led:
        try:
            wallfacer_attention(q, k, v, dist.group.WORLD, c, ulysses_size=u)
        except ValueError as e:
            assert set(led.as_dict()) == {"all_gather@world"}, led.as_dict()  # the checks' metadata only
            return str(e)
    return f"no error on rank {me}"


BAD = {
    "u_not_dividing_p": "ulysses_size U=3 must divide the P=8 context-parallel ranks (valid: [1, 2, 4, 8])",
    "heads": "ulysses_size U=4: the 6 query heads (per tensor-parallel rank) must divide by U",
    "kv_heads": "ulysses_size U=4: the 6 K/V heads (per tensor-parallel rank) must be a multiple of U or "
                "divide U",
    "team_size": "team_size C=2 is invalid for P=2 ranks: C² must divide P (valid: 1) (WallFacer runs over "
                 "P/U = 2 groups)",
    "u_on_one_rank": "the ranks of group world must agree on ulysses_size, got ulysses_size: rank 0=2, "
                     "rank 1=2, rank 2=2, rank 3=2, rank 4=2, rank 5=4, rank 6=2, rank 7=2",
}


@pytest.mark.world_size(8)
def test_bad_ulysses_size_raises_same_error_on_every_rank(world):
    for kind, want in BAD.items():
        messages = world.run(_bad, kind)
        assert len(set(messages)) == 1, (kind, messages)
        assert want in messages[0], (kind, messages[0])


def test_rows_after_the_all_to_all_are_the_outer_layout():
    """Outer rank γ holds CP ranks γU … γU+U−1's rows, member after member; as a set of stream positions they
    are what rank γ holds in the same layout over P/U ranks (coarse chunks of U chunks): dense, and packed
    with documents whose lengths 2P divides (equal chunks)."""
    for layout in ("zigzag", "contiguous"):
        for p, u in ((8, 2), (8, 4), (8, 8), (12, 3), (16, 4)):
            for pack in (packing.dense(8 * p), packing.from_cu_seqlens([0, 2 * p, 8 * p, 14 * p])):
                fine, coarse = packing.shards(pack, layout, p), packing.shards(pack, layout, p // u)
                for gamma, runs in enumerate(outer_shards(fine, u)):
                    assert sorted(packing.rank_index(runs)) == sorted(packing.rank_index(coarse[gamma]))


def test_kv_heads_each_member_needs():
    """Query head j reads K/V head j // (h/g); member m holds query heads [m·h/U, (m+1)·h/U)."""
    for h, g, u in ((8, 8, 2), (8, 2, 2), (8, 4, 8), (8, 1, 4), (16, 2, 8), (12, 6, 3)):
        assert ulysses_error(8 if u != 3 else 12, u, h, g) is None
        for m in range(u):
            needed = sorted({j // (h // g) for j in range(m * h // u, (m + 1) * h // u)})
            assert kv_heads_of(m, g, u) == needed
    assert "multiple of U or divide U" in ulysses_error(8, 4, 12, 6)


@pytest.mark.world_size(8)
def test_megatron_layer_with_the_hybrid_equals_cp1(world):
    """CP = 8 with U = 2, C = 2 (K/V heads split), and TP = 2 x CP = 4 with U = 2, C = 1 (one K/V head per
    TP rank, replicated to both Ulysses members); the team Q/K/V kept in one, rebuilt in the other."""
    from megatron_patches import WallFacerConfig
    from tests.megatron_patches.test_attention import _assert_close, _layer_case

    for tp, wf in ((1, WallFacerConfig(team_size=2, ulysses_size=2, team_qkv="rebuild")),
                   (2, WallFacerConfig(team_size=1, ulysses_size=2, team_qkv="keep"))):
        results = world.run(_layer_case, tp, wf)
        assert results[0]["wallfacer"] == "WallFacerAttention"
        _assert_close(results)


def test_megatron_lm_arguments():
    from megatron_patches.args import WallFacerConfig
    from tests.megatron_patches.test_args import BASE, _parse

    cfg = WallFacerConfig.from_args(_parse(BASE + " --wallfacer-ulysses-size 2 --wallfacer-team-size 2"
                                           " --wallfacer-team-qkv keep"))
    assert (cfg.ulysses_size, cfg.team_size, cfg.team_qkv) == (2, 2, "keep")
    auto = WallFacerConfig.from_args(_parse(BASE + " --wallfacer-ulysses-size auto"))
    assert (auto.ulysses_size, auto.team_qkv) == ("auto", "auto")
    for line, want in ((" --wallfacer-ulysses-size 3", "ulysses_size U=3 must divide the P=8"),
                       (" --wallfacer-ulysses-size 4 --wallfacer-team-size 2",
                        "team_size C=2 is invalid for P=2 ranks"),
                       (" --wallfacer-ulysses-size 4 --num-query-groups 6 --num-attention-heads 12",
                        "the 6 K/V heads (per tensor-parallel rank) must be a multiple of U or divide U")):
        with pytest.raises(ValueError, match=re.escape(want)):
            WallFacerConfig.from_args(_parse(BASE + line))
    with pytest.raises(SystemExit):
        _parse(BASE + " --wallfacer-team-qkv sometimes")
