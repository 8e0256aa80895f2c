"""Packed (THD) batches through wallfacer_attention on gloo worlds: exact against single-process attention
inside each document (fp64, forward and the three input gradients) for WallFacer, ring attention (C = 1)
and the Ulysses hybrid, both layouts, documents of any lengths (spanning ranks, shorter than a chunk,
padded spans); each rank's work counted by a kernel that counts the scores it is asked for; the packing
agreed across ranks."""

import random

import pytest
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from benchmarks.packed_check import document_attention
from commweave import ledger
from megatron_patches import packing
from megatron_patches.block import ReferenceKernel
from megatron_patches.hybrid import outer_shards
from megatron_patches.layout import Layout, valid_team_sizes
from megatron_patches.rowmap import rank_scores
from megatron_patches.wallfacer import wallfacer_attention
from tests.megatron_patches.test_wallfacer import _global_inputs

TOL = 1e-10
# Document lengths (valid, padded span or None). Every batch has a document longer than a rank's rows, one
# shorter than 2P (chunks of 0 or 1 token), and lengths with every remainder mod 2P.
BATCHES = {
    "mixed": ([37, 5, 1, 64, 19, 3, 50], None),
    "one long": ([200, 7], None),
    "te padded": ([13, 30, 4], [16, 32, 8]),
    "short docs": ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], None),
}


def params(lengths, padded=None) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pad = None if padded is None else torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()],
                                                   dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pad,
                           cu_seqlens_kv_padded=pad, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def doc_of(pack: packing.Packing, rows: int) -> torch.Tensor:
    """Each stream position's document (−1: padding), for ``rows`` positions (the stream and the layout's
    end padding)."""
    doc = torch.full((rows,), -1)
    for d, (start, valid, _) in enumerate(pack.spans):
        doc[start:start + valid] = d
    return doc


def _case(batch, u, c, causal, hq, hkv, mode, team_qkv, layout, b=2, d=8):
    world = dist.get_world_size()
    lengths, padded = BATCHES[batch]
    ps = params(lengths, padded)
    pack = packing.from_packed_seq_params(ps)
    shards = packing.shards(pack, layout, world)
    total = packing.rows_per_rank(pack, world) * world
    q, k, v, do = _global_inputs(total, b, hq, hkv, d)
    doc = doc_of(pack, total)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = document_attention(*inputs, doc, d ** -0.5, causal)
    want.backward(do)
    want = [want] + [t.grad for t in inputs]
    rows = torch.tensor(packing.rank_index(shards[dist.get_rank()]))
    mine = [t[rows].clone().requires_grad_() for t in (q, k, v)]
    out = wallfacer_attention(*mine, dist.group.WORLD, c, causal=causal, layout=layout, backward=mode,
                              team_qkv=team_qkv, ulysses_size=u, packed_seq_params=ps)
    out.backward(do[rows])
    got = [out] + [t.grad for t in mine]
    return [(g - w[rows]).abs().max().item() for g, w in zip(got, want, strict=True)]


def _cases(world):
    out = []
    for batch in BATCHES:
        for u in (1, 2):
            for c in valid_team_sizes(world // u):
                for causal in (True, False):
                    hkv, mode, team_qkv = (2, "kv", "keep") if c == 1 else (2, "q", "rebuild")
                    out.append((batch, u, c, causal, 4, hkv, mode, team_qkv, "zigzag"))
    out += [("mixed", 1, 2, True, 4, 4, "kv", "rebuild", "zigzag"),      # MHA, GQA, MQA; both backwards
            ("mixed", 1, 2, True, 4, 1, "q", "keep", "zigzag"),
            ("mixed", 1, 2, True, 4, 2, "kv", "keep", "contiguous"),
            ("short docs", 1, 1, True, 4, 2, "q", "rebuild", "contiguous"),
            ("mixed", 4, 1, True, 4, 2, "kv", "auto", "zigzag"),          # U = P: Ulysses alone
            ("te padded", 2, 1, True, 4, 4, "q", "keep", "contiguous")]
    return out


def _numerics(cases):
    return {case: _case(*case) for case in cases}


@pytest.mark.world_size(4)
def test_packed_exact_against_document_attention_p4(world):
    cases = _cases(4)
    results = world.run(_numerics, cases)
    bad = {case: err for case in cases if (err := max(max(r[case]) for r in results)) > TOL}
    assert not bad, f"over {TOL} (batch, U, C, causal, hq, hkv, backward, team_qkv, layout): {bad}"


@pytest.mark.world_size(8)
def test_packed_exact_against_document_attention_p8(world):
    """P = 8: C = 2 (G = 2 sub-ring steps), the hybrid U = 2 with C = 2 and U = 4, both backwards."""
    cases = [("mixed", 1, 2, True, 4, 2, "kv", "rebuild", "zigzag"),
             ("one long", 1, 2, True, 4, 2, "q", "keep", "zigzag"),
             ("short docs", 2, 2, True, 4, 2, "q", "rebuild", "zigzag"),
             ("te padded", 4, 1, True, 4, 4, "kv", "keep", "zigzag"),
             ("mixed", 1, 1, False, 4, 1, "kv", "auto", "contiguous")]
    results = world.run(_numerics, cases)
    bad = {case: err for case in cases if (err := max(max(r[case]) for r in results)) > TOL}
    assert not bad, f"over {TOL}: {bad}"


class CountingKernel(ReferenceKernel):
    """The reference kernel, counting the scores each call computes (a causal n x n block: n(n+1)/2)."""

    def __init__(self):
        self.forward_scores = self.backward_scores = self.calls = 0

    @staticmethod
    def _scores(q, k, causal):
        n, m = q.shape[2], k.shape[2]
        return n * (n + 1) // 2 if causal else n * m

    def forward(self, q, k, v, scale, causal):
        self.forward_scores += self._scores(q, k, causal)
        self.calls += 1
        return super().forward(q, k, v, scale, causal)

    def backward(self, do, q, k, v, o, lse, scale, causal):
        self.backward_scores += self._scores(q, k, causal)
        return super().backward(do, q, k, v, o, lse, scale, causal)


def _work_case(lengths, c, u, mode):
    ps = params(lengths)
    pack = packing.from_packed_seq_params(ps)
    s = packing.rows_per_rank(pack, dist.get_world_size())
    torch.manual_seed(dist.get_rank())
    q, k, v = (torch.randn(s, 1, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kernel = CountingKernel()
    out = wallfacer_attention(q, k, v, dist.group.WORLD, c, kernel=kernel, backward=mode, ulysses_size=u,
                              packed_seq_params=ps)
    out.sum().backward()
    return kernel.forward_scores, kernel.backward_scores


def _cu(lengths) -> list[int]:
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def _random_lengths(seed: int, total: int) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(int(2 ** rng.uniform(0, 10)), total - sum(lengths)))
    return lengths


@pytest.mark.world_size(4)
def test_each_rank_computes_its_documents_share_within_10_percent(world):
    """The scores each rank's kernel computes (forward and backward) sum to the documents' own causal
    scores, Σ L(L+1)/2 (no block of two documents, nothing twice), and every rank's share is within 10% of
    the mean: ring, WallFacer C = 2, the hybrid U = 2 (its ranks attend h/U heads: the same rows)."""
    for seed in range(3):
        lengths = _random_lengths(seed, 3000)
        want = packing.causal_work(packing.from_cu_seqlens(_cu(lengths)))
        for c, u, mode in ((1, 1, "kv"), (2, 1, "q"), (1, 2, "kv")):
            work = world.run(_work_case, lengths, c, u, mode)
            fwd = [f for f, _ in work]
            assert [b for _, b in work] == fwd, work
            assert sum(fwd) == want * u, (c, u, fwd, want)  # U members attend the same rows
            shards = packing.shards(packing.from_cu_seqlens(_cu(lengths)), "zigzag", 4)
            plan = rank_scores(outer_shards(shards, u) if u > 1 else shards, Layout(4 // u, c))
            assert fwd == [plan[r // u] for r in range(4)], (fwd, plan)  # what the benchmark's table shows
            mean = sum(fwd) / len(fwd)
            assert max(abs(f - mean) for f in fwd) <= 0.10 * mean, (seed, c, u, fwd)


def _disagree(kind):
    me = dist.get_rank()
    lengths = [20, 12] if kind == "documents" and me == 2 else [16, 16]
    ps = params(lengths)
    q = torch.randn(8, 1, 4, 8)
    with ledger.recording() as led:
        try:
            if kind == "rows":
                q = torch.randn(9, 1, 4, 8)
            elif kind == "bad cu" and me == 1:
                ps.cu_seqlens_q = ps.cu_seqlens_kv = torch.tensor([0, 20, 12], dtype=torch.int32)
            wallfacer_attention(q, q[:, :, :2], q[:, :, :2], dist.group.WORLD, 2, packed_seq_params=ps)
        except ValueError as e:
            assert set(led.as_dict()) <= {"all_gather@world"}, led.as_dict()
            return str(e)
    return "no error"


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind, want", [
    ("documents", "ranks disagree: rank 2 passes q [8, 1, 4, 8] float32"),
    ("rows", "the packed batch is a stream of 32 tokens: every rank holds ⌈32/P⌉ = 8 rows"),
    ("bad cu", "rank 1: packed_seq_params: cu_seqlens must be non-decreasing, got [0, 20, 12]"),
])
def test_packings_that_differ_or_do_not_fit_raise_on_every_rank(world, kind, want):
    messages = world.run(_disagree, kind)
    assert len(set(messages)) == 1 and want in messages[0], messages
