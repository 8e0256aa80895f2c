"""Packed batches and sequence layouts through a megatron-core GPTModel: with CP = P (WallFacer, ring, the
Ulysses hybrid; rows from packed_batch.get_packed_batch_on_this_cp_rank) the per-token losses, the loss
and every parameter gradient equal those of the same model at CP = 1 with the same packing and an oracle
core attention (fp64); a contiguously sharded batch is exact with layout="contiguous" and refused on every
rank with the zigzag layout when the model's position ids are watched.

megatron-core on CPU as in test_attention.py (custom core attention, learned absolute positions — reset
per document, as Megatron-LM's --reset-position-ids gives them)."""

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from megatron_patches import packing
from tests.megatron_patches import megatron_state
from tests.megatron_patches.test_attention import _config, _grads, _spec
from tests.megatron_patches.test_packed import document_attention, params

TOL = 1e-10
LENGTHS = [37, 5, 1, 64, 19, 3, 50, 2]  # 181 tokens: documents spanning ranks, shorter than a chunk


class DocumentCoreAttention(torch.nn.Module):
    """The CP = 1 oracle: each token attends the earlier tokens of its document (packed_seq_params), or
    the whole causal sequence without it; [s, b, ·, d] or THD [t, ·, d] in, as Megatron hands them."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale or config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        thd = packed_seq_params is not None
        if thd:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            pack = packing.from_packed_seq_params(packed_seq_params)
            doc = torch.full((query.shape[0],), -1)
            for d, (start, valid, _) in enumerate(pack.spans):
                doc[start:start + valid] = d
        else:
            doc = torch.zeros(query.shape[0], dtype=torch.long)
        out = document_attention(query, key, value, doc, self.scale, causal=True)
        return out.reshape(out.shape[0], -1) if thd else out.reshape(out.shape[0], out.shape[1], -1)


def _model(cp, wf, seq, vocab):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if wf is None:
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = DocumentCoreAttention
    else:
        spec = _spec(wf, full=False)
    torch.manual_seed(0)
    return GPTModel(config=_config(cp), transformer_layer_spec=spec, vocab_size=vocab,
                    max_sequence_length=seq, position_embedding_type="learned_absolute").double()


def _batch(lengths, vocab, reset):
    torch.manual_seed(1)
    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths]) if reset else torch.arange(total)
    return {"tokens": torch.randint(0, vocab, (1, total)), "labels": torch.randint(0, vocab, (1, total)),
            "loss_mask": torch.ones(1, total, dtype=torch.float64), "position_ids": positions[None]}


def _packed_gpt_case(wf, lengths, layout="zigzag", vocab=64):
    """CP = P packed vs CP = 1 packed: per-token loss, the total, every parameter gradient."""
    from megatron.core import parallel_state as ps

    from megatron_patches import get_packed_batch_on_this_cp_rank, watch_positions

    cp = dist.get_world_size()
    megatron_state.initialize(1, cp)
    try:
        seq = max(lengths) + cp
        ref, model = _model(1, None, seq, vocab), _model(cp, wf, seq, vocab)
        model.load_state_dict(ref.state_dict())
        watch_positions(model)
        batch = _batch(lengths, vocab, reset=True)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        whole = params(lengths)
        loss_ref = ref(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=whole)
        (loss_ref * batch["loss_mask"]).sum().backward()
        mine, ps_mine = get_packed_batch_on_this_cp_rank(dict(batch), cu, layout=layout)
        loss = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"],
                     packed_seq_params=ps_mine)
        (loss * mine["loss_mask"]).sum().backward()
        total = (loss.detach().double() * mine["loss_mask"]).sum()
        comm.all_reduce(total, ps.get_context_parallel_group())
        grads = _grads(model)
        for g in grads.values():
            comm.all_reduce(g, ps.get_context_parallel_group())
        ref_grads = _grads(ref)
        index = torch.tensor(packing.rank_index(packing.shards(packing.from_cu_seqlens(cu.tolist()), layout,
                                                               cp)[ps.get_context_parallel_rank()]))
        real = index < sum(lengths)
        return {"token_loss": (loss[0, real] - loss_ref[0, index[real]]).abs().max().item(),
                "loss": abs(total.item() - (loss_ref.double() * batch["loss_mask"]).sum().item()),
                "params": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                "padding rows": int((~real).sum())}
    finally:
        megatron_state.release()


def _wf(**kw):
    from megatron_patches import WallFacerConfig

    return WallFacerConfig(**kw)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kw, layout", [({"team_size": 2}, "zigzag"), ({"team_size": 1}, "zigzag"),
                                        ({"team_size": 1, "ulysses_size": 2}, "zigzag"),
                                        ({"team_size": 2, "layout": "contiguous"}, "contiguous")],
                         ids=["wallfacer C=2", "ring", "hybrid U=2", "contiguous C=2"])
def test_packed_gpt_model_cp4_equals_cp1(world, kw, layout):
    results = world.run(_packed_gpt_case, _wf(**kw), LENGTHS, layout)
    assert sum(r["padding rows"] for r in results) == 3  # (-181) mod 4 rows of padding over the 4 ranks
    for r in results:
        assert max(r["token_loss"], r["loss"], r["params"]) < TOL, r


def _layout_case(wf_layout, data_layout, watch, seq=16, vocab=64):
    """A dense batch sharded in ``data_layout``, the model told ``wf_layout``: errors vs CP = 1, or the
    ValueError."""
    from megatron.core import parallel_state as ps

    from megatron_patches import watch_positions

    cp = dist.get_world_size()
    megatron_state.initialize(1, cp)
    try:
        ref, model = _model(1, None, seq, vocab), _model(cp, _wf(team_size=2, layout=wf_layout), seq, vocab)
        model.load_state_dict(ref.state_dict())
        if watch:
            watch_positions(model)
        batch = _batch([seq], vocab, reset=False)
        rows = torch.tensor(packing.rank_index(packing.shards(packing.dense(seq), data_layout, cp)[
            ps.get_context_parallel_rank()]))
        loss_ref = ref(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_ref.sum().backward()
        try:
            loss = model(batch["tokens"][:, rows], batch["position_ids"][:, rows], None,
                         labels=batch["labels"][:, rows])
        except ValueError as e:
            return str(e)
        loss.sum().backward()
        grads = _grads(model)
        for g in grads.values():
            comm.all_reduce(g, ps.get_context_parallel_group())
        ref_grads = _grads(ref)
        return {"token_loss": (loss - loss_ref[:, rows]).abs().max().item(),
                "params": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)}
    finally:
        megatron_state.release()


@pytest.mark.world_size(4)
def test_contiguous_shards_are_exact_with_their_layout_and_refused_with_zigzag(world):
    for r in world.run(_layout_case, "contiguous", "contiguous", True):
        assert max(r.values()) < TOL, r
    messages = world.run(_layout_case, "zigzag", "contiguous", True)
    assert len(set(messages)) == 1, messages
    assert "the batch is in the contiguous layout; pass layout='contiguous'" in messages[0], messages[0]
    assert ("rank 0 (and 3 other rank(s)): positions [0, 1, 2, 3] on this rank are not the zigzag layout's "
            "[0, 1, 14, 15]") in messages[0], messages[0]
    # Unwatched, nothing in q, k, v tells the layout: the silent error the position check prevents.
    silent = world.run(_layout_case, "zigzag", "contiguous", False)
    assert max(r["params"] for r in silent) > 1e-3
