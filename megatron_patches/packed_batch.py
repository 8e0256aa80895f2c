"""The data path of a packed batch: which rows each context-parallel rank takes (packing.py's layouts), in
Megatron's vocabulary, and the documents of Megatron-LM's ``--reset-attention-mask`` batches.

``get_packed_batch_on_this_cp_rank`` is ``megatron.core.utils.get_thd_batch_on_this_cp_rank`` (same
arguments and return, same ``PackedSeqParams``) for WallFacer's layouts, without TransformerEngine: it
needs no document padded to a multiple of 2·CP (where every one is, it takes TE's very rows), and adds
the (−T) mod CP padding rows that the layout needs at the end of every tensor (tokens and labels 0,
loss mask 0, position 0). Megatron-LM's own THD path (``get_thd_batch_on_this_cp_rank``, TE's
``thd_get_partitioned_indices``) feeds WallFacer's zigzag layout unchanged.

Megatron-LM's GPT datasets pack documents into samples too: with ``--reset-attention-mask`` a document
ends after each end-of-document token, and the dataset builds a dense [1, s, s] mask of the documents'
causal blocks (``_get_ltor_masks_and_position_ids``). :func:`documents` reads the same documents as
cumulative lengths, so the batch can go through the THD path (no s x s mask, no score between two
documents computed).
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_patches import packing

SKIP = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def get_packed_batch_on_this_cp_rank(batch: dict, cu_seqlens: torch.Tensor,
                                     cu_seqlens_padded: torch.Tensor | None = None, max_seqlen=None, *,
                                     cp_size: int | None = None, cp_rank: int | None = None,
                                     layout: str = "zigzag") -> tuple[dict, PackedSeqParams]:
    """This CP rank's rows of a packed micro-batch (every tensor [b, T] along dim 1, T the stream's tokens)
    and the PackedSeqParams to pass the model. ``cu_seqlens`` (``cu_seqlens_padded``): the global cumulative
    document lengths (padded spans), int32; CP size and rank default to Megatron's parallel state."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    pack = packing.from_cu_seqlens(packing.host_ints(cu_seqlens, "cu_seqlens"),
                                   packing.host_ints(cu_seqlens_padded, "cu_seqlens_padded"))
    runs = packing.shards(pack, layout, cp_size)[cp_rank]
    index = torch.tensor(packing.rank_index(runs))
    out = {}
    for key, data in batch.items():
        if key in SKIP or data is None:
            out[key] = None if key == "attention_mask" else data
            continue
        if data.shape[1] != pack.total:
            raise ValueError(f"batch[{key!r}] has {data.shape[1]} positions, the packing {pack.total}")
        pad = torch.zeros_like(data[:, :1]).expand(data.shape[0], packing.padding(pack, cp_size),
                                                   *data.shape[2:])
        out[key] = torch.cat([data, pad], 1).index_select(1, index.to(data.device))
    cu = cu_seqlens.reshape(-1).to(torch.int32)
    padded = None if cu_seqlens_padded is None else cu_seqlens_padded.reshape(-1).to(torch.int32)
    longest = int(torch.as_tensor(max_seqlen).max()) if max_seqlen is not None else \
        max(v for _, v, _ in pack.spans)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    return out, params


def documents(batch: dict, eod: int | None = None) -> tuple[dict, torch.Tensor]:
    """A ``--reset-attention-mask`` batch of b rows as one packed stream of b·s tokens (every tensor [1, b·s],
    the dense mask dropped) and its documents' cumulative lengths, int32: a document ends after each
    end-of-document token ``eod``, as Megatron's _get_ltor_masks_and_position_ids cuts them (read from the
    dense [b, 1, s, s] mask when the batch has one, True = masked: row i starts a document where it may
    not see key i − 1), and at the end of every row."""
    mask, tokens = batch.get("attention_mask"), batch["tokens"]
    b, s = tokens.shape
    if mask is not None:
        m = mask.reshape(b, s, s)
        cut = m.diagonal(-1, dim1=-2, dim2=-1)  # [b, s − 1]: row i + 1 may not see key i
    elif eod is not None:
        cut = tokens[:, :-1] == eod
    else:
        raise ValueError("the documents of a batch need its dense attention mask or its end-of-document "
                         "token")
    starts = [r * s + i + 1 for r in range(b) for i in torch.nonzero(cut[r]).flatten().tolist()]
    bounds = sorted({0, b * s, *starts, *(r * s for r in range(b))})
    flat = {key: (None if key == "attention_mask" else v if key in SKIP or v is None else v.reshape(1, b * s))
            for key, v in batch.items()}
    return flat, torch.tensor(bounds, dtype=torch.int32, device=tokens.device)
