"""The packed batch's data path (packed_batch.py), in one process: the documents of a --reset-attention-mask
batch read from Megatron's own dense mask equal those read from the end-of-document tokens, rows never
share a document, and a batch sharded for CP ranks holds every token once plus the layout's padding."""

import itertools

import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_patches import packing
from megatron_patches.packed_batch import documents, get_packed_batch_on_this_cp_rank

EOD = 9


def _sample(seed, s=48):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD, (s,), generator=gen)
    tokens[torch.rand(s, generator=gen) < 0.15] = EOD
    return tokens


def test_documents_from_megatrons_mask_equal_those_from_the_eod_tokens():
    for seed in range(20):
        rows = [_sample(seed * 2 + r) for r in range(2)]
        masks, positions = [], []
        for row in rows:  # what GPTDataset builds with --reset-attention-mask --reset-position-ids
            mask, _, pos = _get_ltor_masks_and_position_ids(row, EOD, True, True, False, True)
            masks.append(mask)
            positions.append(pos)
        batch = {"tokens": torch.stack(rows), "labels": torch.stack(rows),
                 "position_ids": torch.stack(positions), "attention_mask": torch.stack(masks)}
        flat, from_mask = documents(batch)
        _, from_eod = documents({**batch, "attention_mask": None}, EOD)
        assert from_mask.tolist() == from_eod.tolist()
        assert flat["attention_mask"] is None and flat["tokens"].shape == (1, 96)
        assert 48 in from_mask.tolist()  # the rows' boundary
        cu = from_mask.tolist()  # --reset-position-ids restarts at every document
        for a, b in itertools.pairwise(cu):
            assert flat["position_ids"][0, a:b].tolist() == list(range(b - a))


def test_sharded_batch_holds_every_token_once_and_the_padding():
    tokens = torch.arange(1, 31)[None]  # 30 tokens, no zero among them
    cu = torch.tensor([0, 7, 8, 21, 30], dtype=torch.int32)
    seen = []
    for rank in range(4):
        out, params = get_packed_batch_on_this_cp_rank({"tokens": tokens, "loss_mask": torch.ones(1, 30)}, cu,
                                                       cp_size=4, cp_rank=rank)
        assert out["tokens"].shape == (1, 8) and params.qkv_format == "thd" and params.max_seqlen_q == 13
        assert torch.equal(params.cu_seqlens_q, cu) and params.cu_seqlens_kv_padded is None
        assert torch.equal(out["loss_mask"][0] == 0, out["tokens"][0] == 0)  # padding rows: 0 and masked
        seen += [t for t in out["tokens"][0].tolist() if t]
    assert sorted(seen) == list(range(1, 31))
    assert packing.padding(packing.from_cu_seqlens(cu.tolist()), 4) == 2
