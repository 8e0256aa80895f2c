"""Packed-batch layouts (packing.py) and the per-document block rule (rowmap.py), checked in one process:
the shards partition the stream, equal TransformerEngine's THD partition where that is defined and
Megatron's dense zigzag for one document, pad only (−T) mod P rows; the calls between any two teams
compute exactly the causal pairs inside each document, once; and the causal work per rank is balanced
for WallFacer, ring attention and the hybrid."""

import random
import statistics

import pytest

from megatron_patches import packing
from megatron_patches.hybrid import outer_shards
from megatron_patches.layout import Layout, rank_chunks, valid_team_sizes
from megatron_patches.placement import ring_major
from megatron_patches.rowmap import block_calls, rank_scores, team_rows


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _random_lengths(rng, total, top_bits):
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(2 ** rng.uniform(0, top_bits)), total - sum(lengths)))
    return lengths


def _random_packing(rng):
    lengths = _random_lengths(rng, rng.randrange(40, 400), rng.choice([3, 6, 9]))
    if rng.random() < 0.3:  # padded spans, as a user's (or TE's) data path pads
        return packing.from_cu_seqlens(_cu(lengths), _cu([n + rng.randrange(4) for n in lengths]))
    return packing.from_cu_seqlens(_cu(lengths))


def test_shards_partition_the_stream_with_equal_rows():
    rng = random.Random(0)
    for _ in range(300):
        pack, p = _random_packing(rng), rng.choice([1, 2, 3, 4, 8, 16])
        for layout in packing.LAYOUTS:
            shards = packing.shards(pack, layout, p)
            s = packing.rows_per_rank(pack, p)
            assert all(sum(n for _, n, _ in runs) == s for runs in shards)
            seen = sorted(i for runs in shards for i in packing.rank_index(runs))
            assert seen == list(range(s * p)), (pack, layout, p)
            assert s * p - pack.total == packing.padding(pack, p) < p
            for runs in shards:
                for start, n, doc in runs:
                    span = pack.spans[doc] if doc >= 0 else None
                    if span is not None:  # a document's run lies inside its valid tokens
                        assert span[0] <= start and start + n <= span[0] + span[1]
                    else:  # padding: a span's tail, or past the stream
                        assert all(not (sp[0] <= i < sp[0] + sp[1]) for sp in pack.spans
                                   for i in range(start, start + n))


def _te_partition(cu_padded, world, rank):
    """TransformerEngine's thd_get_partitioned_indices (fused_attn/thd_utils.cu), token by token: the
    local token t of sequence i (each padded length divisible by 2·world) is index t − start_i/world of
    that sequence's local part, which reads chunk ``rank`` for its first half, chunk 2·world−1−rank for
    its second."""
    out = []
    for i in range(len(cu_padded) - 1):
        local = (cu_padded[i + 1] - cu_padded[i]) // world
        half = local // 2
        for index in range(local):
            offset = rank if index < half else 2 * world - 1 - rank
            out.append(cu_padded[i] + offset * half + index % half)
    return out


def test_zigzag_is_transformer_engines_thd_partition_and_megatrons_dense_zigzag():
    rng = random.Random(1)
    for _ in range(50):
        p = rng.choice([1, 2, 4, 8])
        lengths = [rng.randrange(1, 6) * 2 * p for _ in range(rng.randrange(1, 6))]
        cu = _cu(lengths)
        shards = packing.shards(packing.from_cu_seqlens(cu), "zigzag", p)
        assert [packing.rank_index(runs) for runs in shards] == [_te_partition(cu, p, r) for r in range(p)]
    for p in (1, 2, 4, 8):
        for layout in packing.LAYOUTS:
            shards = packing.shards(packing.dense(16 * p), layout, p)
            for r, runs in enumerate(shards):  # get_batch_on_this_cp_rank's chunks r and 2P−1−r
                want = [c * 8 + i for c in rank_chunks(layout, p, r) for i in range(8)]
                assert packing.rank_index(runs) == want


def test_padding_is_zero_when_p_divides_the_stream_and_te_would_pad_every_document():
    lengths = [2 * 8 + 1] * 100 + [5, 7]  # every document's length has a remainder mod 2P = 16
    pack = packing.from_cu_seqlens(_cu(lengths))
    assert pack.total % 8 == 0 and packing.padding(pack, 8) == 0
    te = sum(-n % 16 for n in lengths)  # TE pads each document to a multiple of 2P
    assert te == 100 * 15 + 11 + 9
    assert packing.padding(packing.from_cu_seqlens(_cu([7, 4])), 4) == 1


def _pairs(q_rows, k_rows, q_pos, k_pos, calls):
    """(query position, key position) pairs the calls compute; a causal call masks by row inside it."""
    out = []
    for q0, q1, k0, k1, diag in calls:
        for i in range(q0, q1):
            for j in range(k0, k1):
                if not diag or j - k0 <= i - q0:
                    out.append((q_pos[i], k_pos[j]))
    return out


def _sorted_positions(rows):
    pos = [0] * rows.rows
    for row, n, start, _ in rows.runs:
        pos[row:row + n] = range(start, start + n)
    return pos


def test_calls_compute_each_causal_pair_inside_a_document_once():
    """For random packings, layouts, P, C and orders: the calls of any (query team, key team) compute
    exactly the pairs (a, b) of one document with b <= a (causal) or any b (non-causal), each once."""
    rng = random.Random(2)
    for _ in range(200):
        pack, p = _random_packing(rng), rng.choice([2, 4, 8, 16])
        c, layout = rng.choice(valid_team_sizes(p)), rng.choice(packing.LAYOUTS)
        order = rng.choice([(), ring_major(p, c), tuple(rng.sample(range(p), p))])
        lay = Layout(p, c, order, layout)
        shards = packing.shards(pack, layout, p)
        doc = {}
        for d, (start, valid, _) in enumerate(pack.spans):
            doc.update({i: d for i in range(start, start + valid)})
        tq, tk, causal = rng.randrange(lay.teams), rng.randrange(lay.teams), rng.random() < 0.7
        q = team_rows(tuple(shards[r] for r in lay.team_ranks(tq)))
        k = team_rows(tuple(shards[r] for r in lay.team_ranks(tk)))
        q_pos, k_pos = _sorted_positions(q), _sorted_positions(k)
        got = _pairs(q, k, q_pos, k_pos, block_calls(q, k, causal, tq == tk))
        want = [(a, b) for a in q_pos for b in k_pos
                if a in doc and doc.get(b) == doc[a] and (b <= a or not causal)]
        assert sorted(got) == sorted(want), (pack, lay, tq, tk, causal)


def balance(lengths, p, u, c):
    """Max deviation of a rank's causal scores from the mean, relative, for the hybrid U x WallFacer C."""
    pack = packing.from_cu_seqlens(_cu(lengths))
    shards = packing.shards(pack, "zigzag", p)
    inner = outer_shards(shards, u) if u > 1 else shards
    work = rank_scores(inner, Layout(p // u, c))
    assert sum(work) == packing.causal_work(pack)  # no pair of two documents, none twice
    mean = statistics.mean(work)
    return max(abs(w - mean) for w in work) / mean


@pytest.mark.parametrize("p", [4, 8, 16])
def test_per_document_zigzag_balances_causal_work(p):
    """Documents of 1 … 1024 tokens (log-uniform) in batches of 4096 + a few tokens: every rank within 3%
    of the mean (the issue asks for 10%), for every (U, C) of P; with documents of 1 … 128 tokens within
    10%. (Batches made of documents shorter than 2P are not: with C > 1 each team's diagonal block, then
    nearly all the work, falls on one member — README, packed sequences.)"""
    rng = random.Random(p)
    for _ in range(6):
        for top, band in ((10, 0.03), (7, 0.10)):
            lengths = _random_lengths(rng, 4096 + rng.randrange(p), top)
            for u in (x for x in (1, 2, 4) if p % x == 0):
                for c in valid_team_sizes(p // u):
                    assert balance(lengths, p, u, c) <= band, (top, u, c)


def test_positions_and_errors():
    # Documents of 5 and 7 tokens on P = 2: chunks of 1 token plus 1 and 3 extras, round robin from rank 0
    # (rank 0's single extra goes to its low chunk in document 0, its high chunk in document 1).
    pack = packing.from_cu_seqlens([0, 5, 12])
    shards = packing.shards(pack, "zigzag", 2)
    assert [packing.rank_index(runs) for runs in shards] == [[0, 1, 4, 5, 10, 11], [2, 3, 6, 7, 8, 9]]
    assert packing.rank_positions(pack, shards[1], reset=True) == [2, 3, 1, 2, 3, 4]
    assert packing.rank_positions(pack, shards[1], reset=False) == [2, 3, 6, 7, 8, 9]
    padded = packing.from_cu_seqlens([0, 3], [0, 4])  # one document, its span padded by 1, P = 2
    assert packing.rank_positions(padded, packing.shards(padded, "zigzag", 2)[1], reset=True) == [1, 2]
    assert packing.rank_positions(padded, packing.shards(padded, "zigzag", 2)[0], reset=True) == [0, -1]
    assert packing.packing_error([0, 3, 2], None) == "cu_seqlens must be non-decreasing, got [0, 3, 2]"
    assert "must start at 0" in packing.packing_error([1, 3], None)
    assert "document 0 has 3 tokens but a padded span of 2" in packing.packing_error([0, 3], [0, 2])
    with pytest.raises(ValueError, match="cu_seqlens_padded has 3 entries, cu_seqlens 2"):
        packing.from_cu_seqlens([0, 3], [0, 4, 8])
