"""volume.py's formulas against ring attention, the paper's worked example M and its 1/C claim."""

from megatron_patches.layout import Layout, valid_team_sizes
from megatron_patches.volume import Shard, backward_bytes, choose_backward, forward_bytes, mean_p2p, p2p_bytes

GIB = 2 ** 30


def test_c1_is_ring_attention():
    """C = 1: (P−1) hops of K/V forward; backward K/V (P−1) hops plus dK/dV P hops (ring-flash-attention)."""
    sh = Shard(s=8, b=2, hq=4, hkv=2, d=16, elt=2, acc=4)
    for p in (2, 4, 8, 16):
        lay = Layout(p, 1)
        for r in range(p):
            fwd = forward_bytes(lay, sh, r, checked=False)
            assert dict(fwd) == {("send", "ring"): (p - 1) * 2 * sh.a_kv * 2}
            assert dict(backward_bytes(lay, sh, r, "kv")) == {
                ("send", "ring"): (p - 1) * 2 * sh.a_kv * 2 + (p - 1) * 2 * sh.a_kv * 4,
                ("send", "cp"): 2 * sh.a_kv * 4}


def test_paper_count_is_one_over_c_and_measured_mean_is_at_most_that():
    """Placement counted on every rank and ring attention with P hops (paper §5): exactly 1/C."""
    sh = Shard(s=8, b=1, hq=4, hkv=4, d=8, elt=2, acc=4)
    for p in (4, 8, 16, 27, 32, 64, 128):
        ring_paper = p * 2 * sh.a_kv * sh.elt
        for c in valid_team_sizes(p)[1:]:
            lay = Layout(p, c)
            paper = lay.ring_len * 2 * c * sh.a_kv * sh.elt  # G hops, the first being the placement
            assert paper * c == ring_paper
            assert mean_p2p(lay, sh) <= paper
            # Ranks that keep their own team's K/V are where measured and paper counts differ.
            keepers = sum(lay.place_target(r) == r for r in range(p))
            total = sum(p2p_bytes(forward_bytes(lay, sh, r)) for r in range(p))
            assert total == paper * p - keepers * 2 * c * sh.a_kv * sh.elt


def test_measured_mean_is_exactly_one_over_c_when_p_is_c_cubed():
    """P = C³ gives G = C and exactly G keepers: then the measured mean is 1/C of ring attention's."""
    sh = Shard(s=4, b=2, hq=4, hkv=2, d=8, elt=4, acc=4)
    for c in (2, 3, 4):
        p = c ** 3
        assert mean_p2p(Layout(p, c), sh) * c == mean_p2p(Layout(p, 1), sh)


def test_paper_worked_example_m():
    """§5.1 example M (N=65536, H=6656, B=1, P=64, C=4, bf16), per layer: ring 1.625 GiB; StarTrail
    0.152 GiB of collectives and 0.406 GiB of P2P (placement included)."""
    sh = Shard(s=65536 // 64, b=1, hq=52, hkv=52, d=128, elt=2, acc=4)
    assert round(64 * 2 * sh.a_kv * sh.elt / GIB, 3) == 1.625
    lay = Layout(64, 4)
    sender = next(r for r in range(64) if lay.place_target(r) != r)
    fwd = forward_bytes(lay, sh, sender, checked=False)
    assert round(p2p_bytes(fwd) / GIB, 3) == 0.406
    lse = 4 * sh.rows * 3 * sh.acc  # the lse all-gather, which the paper does not count
    collectives = fwd["all_gather", "team"] - lse + fwd["reduce_scatter", "team"]
    assert round(collectives / GIB, 3) == 0.152


def test_backward_choice_follows_the_gqa_ratio():
    lay = Layout(16, 2)
    # MHA in bf16: queries move q, dO and dQ, 2·2 + 4 bytes per element and hop (+ lse and D per row),
    # K/V 2·(2 + 4).
    assert choose_backward(lay, Shard(8, 1, 8, 8, 16, elt=2, acc=4)) == "q"
    # MHA in fp32: 2·4 + 4 (+ lse, D) against 2·(4 + 4): still the queries (with O on the wire, 3·4 + 4
    # + lse, it was K/V).
    assert choose_backward(lay, Shard(8, 1, 8, 8, 16, elt=4, acc=4)) == "q"
    # GQA 2:1 in fp32: 12 (+ rows) against 8.
    assert choose_backward(lay, Shard(8, 1, 8, 4, 16, elt=4, acc=4)) == "kv"
    # GQA 2:1 in bf16: K/V carry half the heads.
    assert choose_backward(lay, Shard(8, 1, 8, 4, 16, elt=2, acc=4)) == "kv"
    # No ring loop (C = √P): both variants are the same placement moves.
    assert choose_backward(Layout(16, 4), Shard(8, 1, 8, 8, 16, elt=2, acc=4)) == "kv"
