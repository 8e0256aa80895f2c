"""WallFacerAttention inside megatron-core: a TransformerLayer and a GPTModel built with the WallFacer spec
give, with CP = P (zigzag shards), the same outputs, loss and gradients as the same model with CP = 1
and a plain full-attention core (torch SDPA). Also the module's refusals.

megatron-core runs on CPU with a custom core attention, ``use_cpu_initialization``, learned absolute
positions, fusions off and dropout 0 (wallfacer.md §12). The models are cast to fp64 after building,
so that the comparison is tight.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commweave import comm
from megatron_patches.layout import rank_chunks
from tests.megatron_patches import megatron_state

TOL = 1e-9


class FullAttention(torch.nn.Module):
    """The CP = 1 oracle: causal softmax attention over the whole sequence (torch SDPA, math)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _config(cp, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
                gradient_accumulation_fusion=False, apply_rope_fusion=False, attention_dropout=0.0,
                hidden_dropout=0.0, context_parallel_size=cp)
    base.update(kw)
    return TransformerConfig(**base)


def _zigzag(seq, cp_rank, cp):
    half = seq // (2 * cp)
    return torch.cat([torch.arange(c * half, (c + 1) * half) for c in rank_chunks("zigzag", cp, cp_rank)])


def _spec(team_size, full):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patches import WallFacerConfig, get_gpt_layer_wallfacer_spec, with_wallfacer

    if full:
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = FullAttention
        return spec
    wf = team_size if isinstance(team_size, WallFacerConfig) else WallFacerConfig(team_size=team_size)
    spec = get_gpt_layer_wallfacer_spec(wf)
    assert spec == with_wallfacer(get_gpt_layer_local_spec(), wf)
    return spec


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _layer_case(tp, team_size, seq=16, b=2):
    """One TransformerLayer: CP = P vs CP = 1, outputs, input gradients and parameter gradients."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module

    world = dist.get_world_size()
    cp = world // tp
    megatron_state.initialize(tp, cp)
    try:
        torch.manual_seed(0)
        ref = build_module(_spec(team_size, full=True), config=_config(1, tensor_model_parallel_size=tp),
                           layer_number=1).double()
        model = build_module(_spec(team_size, full=False), config=_config(cp, tensor_model_parallel_size=tp),
                             layer_number=1).double()
        model.load_state_dict(ref.state_dict())
        torch.manual_seed(1)
        x = torch.randn(seq, b, 32, dtype=torch.float64)
        dy = torch.randn(seq, b, 32, dtype=torch.float64)
        rows = _zigzag(seq, ps.get_context_parallel_rank(), cp)
        x_ref, x_cp = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        y_ref, _ = ref(x_ref, attention_mask=None)
        y_ref.backward(dy)
        y_cp, _ = model(x_cp, attention_mask=None)
        y_cp.backward(dy[rows])
        grads = _grads(model)
        for g in grads.values():  # what Megatron's DDP does over the dp_cp group
            comm.all_reduce(g, ps.get_context_parallel_group())
        ref_grads = _grads(ref)
        return {"out": (y_cp - y_ref[rows]).abs().max().item(),
                "dx": (x_cp.grad - x_ref.grad[rows]).abs().max().item(),
                "params": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                "wallfacer": type(model.self_attention.core_attention).__name__}
    finally:
        megatron_state.release()


def _gpt_case(team_size, seq=16, b=2, vocab=64):
    """A two-layer GPTModel with learned positions: per-token loss and every parameter gradient."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    cp = dist.get_world_size()
    megatron_state.initialize(1, cp)
    try:
        def build(c, full):
            torch.manual_seed(0)
            return GPTModel(config=_config(c), transformer_layer_spec=_spec(team_size, full),
                            vocab_size=vocab, max_sequence_length=seq,
                            position_embedding_type="learned_absolute").double()

        ref, model = build(1, True), build(cp, False)
        model.load_state_dict(ref.state_dict())
        torch.manual_seed(1)
        tokens = torch.randint(0, vocab, (b, seq))
        labels = torch.randint(0, vocab, (b, seq))
        positions = torch.arange(seq).expand(b, seq)
        rows = _zigzag(seq, ps.get_context_parallel_rank(), cp)
        loss_ref = ref(tokens, positions, None, labels=labels)
        loss_ref.sum().backward()
        loss_cp = model(tokens[:, rows], positions[:, rows], None, labels=labels[:, rows])
        loss_cp.sum().backward()
        total = loss_cp.detach().double().sum()  # Megatron's CE returns fp32 per-token losses
        comm.all_reduce(total, ps.get_context_parallel_group())
        grads = _grads(model)
        for g in grads.values():
            comm.all_reduce(g, ps.get_context_parallel_group())
        ref_grads = _grads(ref)
        return {"token_loss": (loss_cp - loss_ref[:, rows]).abs().max().item(),
                "loss": abs(total.item() - loss_ref.double().sum().item()),
                "params": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)}
    finally:
        megatron_state.release()


def _assert_close(results):
    for r in results:
        for key, err in r.items():
            if key != "wallfacer":
                assert err < TOL, r


@pytest.mark.world_size(4)
def test_transformer_layer_cp4_equals_cp1(world):
    results = world.run(_layer_case, 1, 2)
    assert results[0]["wallfacer"] == "WallFacerAttention"
    _assert_close(results)


@pytest.mark.world_size(4)
def test_transformer_layer_tp2_cp2_equals_cp1(world):
    """TP splits heads before core attention: orthogonal to WallFacer (two CP groups of 2, C = 1)."""
    _assert_close(world.run(_layer_case, 2, 1))


@pytest.mark.world_size(8)
def test_transformer_layer_tp2_cp4_team_size2_equals_cp1(world):
    """TP = 2 with C = 2: two CP groups of 4 ranks (strided by TP in global rank), teams of 2 in each."""
    results = world.run(_layer_case, 2, 2)
    assert results[0]["wallfacer"] == "WallFacerAttention"
    _assert_close(results)


def _megatron_dot_product_attention(config, layer_number, mask_type, softmax_scale):
    """megatron-core's own local DotProductAttention, made to run on CPU: its scratch buffer, causal mask
    and dropout RNG fork ask for CUDA, so those three (and nothing of its arithmetic) are swapped for
    CPU equivalents while it is built and run. Returns a callable (query, key, value) -> output."""
    from contextlib import nullcontext
    from unittest import mock

    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import dot_product_attention as dpa

    class _CpuBuffer:
        def get_tensor(self, shape, dtype, name):
            return torch.empty(shape, dtype=dtype)

    class _NoFork:
        def fork(self):
            return nullcontext()

    module = dpa.DotProductAttention(config, layer_number, mask_type, "self", softmax_scale=softmax_scale)

    def run(q, k, v):
        with mock.patch.object(dpa.parallel_state, "get_global_memory_buffer", _CpuBuffer), \
                mock.patch.object(tensor_parallel, "get_cuda_rng_tracker", _NoFork), \
                mock.patch.object(fused_softmax, "get_default_causal_mask",
                                  lambda sq: torch.ones(sq, sq).triu(1).bool()):
            return module(q, k, v, None)

    return run


def _scale_case(seq=16, b=2):
    """WallFacerAttention (CP = 4, C = 2) against megatron-core's DotProductAttention (CP = 1) for every
    combination of softmax_scale, apply_query_key_layer_scaling and layer_number, both mask types."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_patches import WallFacerAttention, WallFacerConfig

    cp = dist.get_world_size()
    megatron_state.initialize(1, cp)
    try:
        torch.manual_seed(3)
        q = torch.randn(seq, b, 4, 8, dtype=torch.float64)
        k, v = (torch.randn(seq, b, 2, 8, dtype=torch.float64) for _ in range(2))
        rows = _zigzag(seq, ps.get_context_parallel_rank(), cp)
        errors = {}
        for scale in (None, 0.3):
            for layer_scaling in (False, True):
                for layer in (1, 3):
                    for mask in (AttnMaskType.causal, AttnMaskType.no_mask):
                        kw = {"apply_query_key_layer_scaling": layer_scaling, "softmax_scale": scale}
                        want = _megatron_dot_product_attention(_config(1, **kw), layer, mask, scale)(q, k, v)
                        ours = WallFacerAttention(_config(cp, **kw), layer, mask, "self", softmax_scale=scale,
                                                  wallfacer=WallFacerConfig(team_size=2))
                        got = ours(q[rows], k[rows], v[rows], None)
                        errors[scale, layer_scaling, layer, mask.name] = (got - want[rows]).abs().max().item()
        return errors
    finally:
        megatron_state.release()


@pytest.mark.world_size(4)
def test_softmax_scale_equals_megatron_dot_product_attention(world):
    for errors in world.run(_scale_case):
        assert len(errors) == 16
        bad = {key: e for key, e in errors.items() if e > TOL}
        assert not bad, f"(softmax_scale, apply_query_key_layer_scaling, layer_number, mask): {bad}"


@pytest.mark.world_size(4)
def test_gpt_model_cp4_equals_cp1(world):
    _assert_close(world.run(_gpt_case, 2))


@pytest.mark.world_size(8)
@pytest.mark.parametrize("team_size", [1, 2])
def test_gpt_model_cp8_equals_cp1(world, team_size):
    _assert_close(world.run(_gpt_case, team_size, seq=32))


def _refusals():
    """Each unsupported setting raises a ValueError naming it (constructor, then forward)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_patches import WallFacerAttention, WallFacerConfig

    megatron_state.initialize(1, dist.get_world_size())
    try:
        wf, cp = WallFacerConfig(team_size=2), dist.get_world_size()
        errors = []

        def build(config=None, mask=AttnMaskType.causal, **kw):
            return WallFacerAttention(config or _config(cp), 1, mask, kw.pop("attention_type", "self"),
                                      wallfacer=kw.pop("wallfacer", wf), **kw)

        for kw in ({"config": _config(cp, attention_dropout=0.1)}, {"mask": AttnMaskType.padding},
                   {"attention_type": "cross"}, {"cp_comm_type": "a2a"}, {"config": _config(2)},
                   {"wallfacer": WallFacerConfig(team_size=3)}, {"config": _config(cp, window_size=(8, 0))}):
            try:
                build(**kw)
                errors.append(f"no error for {kw}")
            except ValueError as e:
                errors.append(str(e))
        module = build()
        q = torch.randn(4, 2, 4, 8)
        kv = torch.randn(4, 2, 2, 8)
        for kw in ({"packed_seq_params": PackedSeqParams(qkv_format="thd")}, {"attention_bias": q},
                   {"attention_mask": torch.zeros(2, 1, 4, 16, dtype=torch.bool)}):
            try:
                module(q, kv, kv, kw.pop("attention_mask", None), **kw)
                errors.append(f"no error for {kw}")
            except ValueError as e:
                errors.append(str(e))
        return errors
    finally:
        megatron_state.release()


@pytest.mark.world_size(4)
def test_refusals_name_the_setting(world):
    expected = ["attention dropout 0.1", "attn_mask_type=AttnMaskType.padding", "attention_type='cross'",
                "cp_comm_type='a2a'", "the CP group has 4 ranks, the config says context_parallel_size=2",
                "team_size C=3 is invalid for P=4", "window_size=(8, 0)", "packed sequences",
                "attention_bias", "--no-create-attention-mask-in-dataloader"]
    for errors in world.run(_refusals):
        assert len(errors) == len(expected)
        for got, want in zip(errors, expected, strict=True):
            assert want in got, (want, got)


def test_specs_swap_every_layer_and_refuse_mla():
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_mtp_layer_spec_for_backend,
    )
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_patches import WallFacerConfig, get_gpt_layer_wallfacer_spec, with_wallfacer
    from megatron_patches.attention import WallFacerAttention

    wf = WallFacerConfig(team_size=2)
    block = TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec(qk_layernorm=True),
                                                    get_gpt_layer_local_spec(num_experts=4)])
    swapped = with_wallfacer(block, wf)
    for layer in swapped.layer_specs:
        core = layer.submodules.self_attention.submodules.core_attention
        assert core.module is WallFacerAttention
        assert core.params == {"wallfacer": wf}
    assert block.layer_specs[0].submodules.self_attention.submodules.core_attention is not core  # a copy
    # What the run asked for stays: qk-layernorm and the MoE MLP.
    assert swapped.layer_specs[0].submodules.self_attention.submodules.q_layernorm is not None
    assert swapped.layer_specs[1].submodules.mlp == block.layer_specs[1].submodules.mlp
    # Multi-token-prediction layers attend too.
    mtp = MultiTokenPredictionBlockSubmodules(layer_specs=[
        get_mtp_layer_spec_for_backend(get_gpt_layer_local_spec(), LocalSpecProvider())])
    inner = with_wallfacer(mtp, wf).layer_specs[0].submodules.transformer_layer
    assert inner.submodules.self_attention.submodules.core_attention.module is WallFacerAttention
    with pytest.raises(ValueError, match="multi_latent_attention is not supported"):
        get_gpt_layer_wallfacer_spec(multi_latent_attention=True)
    with pytest.raises(ValueError, match="multi-latent attention is not supported"):
        with_wallfacer(get_gpt_layer_local_spec(multi_latent_attention=True))
