"""WallFacerAttention: a Megatron-core core attention that runs wallfacer_attention over the CP group.

Drop-in for ``DotProductAttention`` / ``TEDotProductAttention`` (megatron-core 0.16.1): same
constructor and forward signature, swapped in declaratively through the layer ModuleSpec's
``core_attention`` (wallfacer.md §14). Megatron hands it, per CP rank, the zigzag-ordered rows
(``get_batch_on_this_cp_rank``; ``WallFacerConfig.layout`` says which layout the data path uses) with
RoPE already applied:

    query [s/CP, b, np, hn]; key, value [s/CP, b, ng, hn] (GQA un-expanded)  ->  [s/CP, b, np·hn]
    packed (THD, packed_seq_params): query [t, np, hn], key, value [t, ng, hn]  ->  [t, np·hn]

Supported: causal and no-mask self-attention, GQA/MQA, any TP, fp16/bf16/fp32, packed batches
(documents attend only themselves; packed_batch.py shards them). Refused with a ValueError: attention
dropout, explicit masks or biases, sliding windows, softmax offsets, cross-attention, and other
cp_comm_types. :func:`watch_positions` lets the module check the position ids against the layout.
"""

from __future__ import annotations

import copy
import math

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from commweave import comm
from megatron_patches import packing
from megatron_patches.args import CP_COMM_TYPES, WallFacerConfig
from megatron_patches.block import acc_dtype
from megatron_patches.checks import check_inputs
from megatron_patches.choice import Plan, choose_hybrid, ranked, reason
from megatron_patches.layout import team_size_error
from megatron_patches.placement import nodes_of
from megatron_patches.volume import Shard
from megatron_patches.wallfacer import resolve_team_qkv, wallfacer_attention

_MASKS = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}


def megatron_softmax_scale(config, softmax_scale: float | None) -> float:
    """The scale Megatron's attention applies to q·kᵀ: ``softmax_scale``, else 1/√kv_channels.

    DotProductAttention (megatron-core 0.16.1) with ``apply_query_key_layer_scaling`` divides the
    scores by layer_number in the matmul and FusedScaleMaskSoftmax multiplies them back (its
    ``scale=coeff``) before the fp32 softmax: an fp16 range trick that leaves the product unchanged.
    WallFacer's fp32 online softmax needs neither half of it.
    """
    return 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else float(softmax_scale)


def _megatron_lm_config() -> WallFacerConfig:
    try:
        from megatron.training import get_args
    except ImportError:
        raise ValueError("WallFacerAttention needs a WallFacerConfig: build the layer spec with "
                         "get_gpt_layer_wallfacer_spec(WallFacerConfig(...)), or run under Megatron-LM "
                         "with extra_args_provider=add_wallfacer_args") from None
    return WallFacerConfig.from_args(get_args())


def plan_layout(cfg: WallFacerConfig, cp_ranks: list[int], world_size: int, q_shape, kv_heads: int, dtype,
                causal: bool) -> Plan:
    """How WallFacerAttention runs a call: Ulysses size U, team size C and WallFacer's layout over the P/U
    groups, for one CP group (``cp_ranks``: its global ranks; ``world_size``: the job's ranks, for the
    default node size) and this rank's ``q_shape`` [s, b, h, d] with ``kv_heads`` K/V heads.

    A pure function of the config, the shapes and the topology arguments, so every rank plans alike
    without communication (the first call's check agrees the outcome): "auto" settings go to the cost
    model (choice.choose_hybrid, the same choice ``python -m megatron_patches.estimate`` marks).
    """
    s, b, h, d = q_shape
    sh = Shard(s, b, h, kv_heads, d, dtype.itemsize, acc_dtype(dtype).itemsize)
    nodes = nodes_of(cp_ranks, cfg.node_size(world_size))
    if "auto" not in (cfg.team_size, cfg.placement, cfg.ulysses_size):
        return choose_hybrid(len(cp_ranks), sh, nodes, None, causal, ulysses_size=cfg.ulysses_size,
                             team_size=cfg.team_size, placement=cfg.placement, layout=cfg.layout)
    topo = cfg.topology(world_size)
    plans = ranked(len(cp_ranks), sh, nodes, topo, causal, ulysses_size=cfg.ulysses_size,
                   team_size=cfg.team_size, placement=cfg.placement, layout=cfg.layout)
    said = (cfg, tuple(cp_ranks), tuple(q_shape), kv_heads, str(dtype), causal)
    if said not in _SAID and (not dist.is_initialized() or dist.get_rank() == cp_ranks[0]):
        _SAID.add(said)  # once per setting and shape, by the CP group's first rank
        print(reason(plans, topo), flush=True)
    return plans[0]


_SAID: set = set()


class WallFacerAttention(MegatronModule):
    """Core attention over the context-parallel group with WallFacer's teams and sub-rings.

    The constructor is DotProductAttention's plus ``wallfacer`` (a ModuleSpec param); without it
    the settings come from Megatron-LM's parsed ``--wallfacer-*`` arguments.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None,
                 wallfacer: WallFacerConfig | None = None) -> None:
        super().__init__(config=config)
        self.wallfacer = wallfacer if wallfacer is not None else _megatron_lm_config()
        if self.wallfacer.timeout_s is not None:  # --commweave-timeout-s: one setting for the process
            comm.set_timeout(self.wallfacer.timeout_s)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        refusals = {
            f"attention_type={attention_type!r}: WallFacer is self-attention only": attention_type != "self",
            f"attention dropout {dropout}: WallFacer has none, set it to 0": bool(dropout),
            f"attn_mask_type={attn_mask_type}: only causal and no_mask": attn_mask_type not in _MASKS,
            f"cp_comm_type={cp_comm_type!r}: use one of {CP_COMM_TYPES}": cp_comm_type not in CP_COMM_TYPES,
            f"softmax_type={config.softmax_type!r}: only vanilla": config.softmax_type != "vanilla",
            f"window_size={config.window_size}: no sliding windows": config.window_size is not None,
        }
        for refusal, refused in refusals.items():
            if refused:
                raise ValueError(f"WallFacerAttention: {refusal}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        else:
            self.cp_group = pg_collection.cp
        world = comm.size(self.cp_group)
        expected = self.wallfacer.context_parallel_size or config.context_parallel_size
        if world != expected:
            raise ValueError(f"WallFacerAttention: the CP group has {world} ranks, the config says "
                             f"context_parallel_size={expected}")
        u = self.wallfacer.ulysses_size
        if u != "auto" and world % u:
            raise ValueError(f"WallFacerAttention: ulysses_size {u} must divide the {world} CP ranks")
        p = world if u == "auto" else world // u  # auto can always fall back to U = 1
        if self.wallfacer.team_size != "auto" and team_size_error(p, self.wallfacer.team_size):
            raise ValueError(f"WallFacerAttention: {team_size_error(p, self.wallfacer.team_size)}")
        self.recomputed = config.recompute_granularity == "full"
        self.softmax_scale = megatron_softmax_scale(config, softmax_scale)
        self.deterministic = bool(config.deterministic_mode)
        self._plans: dict[tuple, Plan] = {}
        self.positions = None  # this rank's position ids of the current forward, when watched

    def _layout(self, query, key, causal: bool) -> tuple[Plan, bool]:
        """The plan (U, C, WallFacer's layout over the P/U groups) for these shapes, and whether this is
        its first call: then wallfacer_attention checks the inputs and agrees U, C, the backward
        variant and team_qkv over the CP group (one all-gather each, before any other traffic)."""
        sig = (tuple(query.shape), key.shape[2], query.dtype, causal)
        if sig in self._plans:
            return self._plans[sig], False
        ranks = [comm.global_rank(self.cp_group, r) for r in range(comm.size(self.cp_group))]
        try:
            plan = plan_layout(self.wallfacer, ranks, comm.size(dist.group.WORLD), query.shape, key.shape[2],
                               query.dtype, causal)
        except ValueError as e:
            raise ValueError(f"WallFacerAttention: {e}") from None
        self._plans[sig] = plan
        return plan, True

    def forward(self, query, key, value, attention_mask, attn_mask_type: AttnMaskType | None = None,
                attention_bias=None, packed_seq_params=None):
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys/values → [sq, b, np·hn]."""
        mask = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if thd and query.dim() == 3:  # Megatron squeezed the batch dim of [t, 1, ·, d]
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        packed_error = _packed_error(packed_seq_params)
        refusals = {
            str(packed_error): packed_error is not None,
            "attention_bias is not supported": attention_bias is not None,
            "explicit attention masks are not supported; the mask type (causal or no_mask) says it all. In "
            "Megatron-LM pass --no-create-attention-mask-in-dataloader": attention_mask is not None,
            f"attn_mask_type={mask}: only causal and no_mask": mask not in _MASKS,
        }
        refusal = next((reason for reason, refused in refusals.items() if refused), None)
        if refusal is not None:  # raised on every CP rank: the others are in their first call's input check
            check_inputs(query, key, value, self.cp_group, 1, True, None, self.wallfacer.layout,
                         error=f"WallFacerAttention: {refusal}")
        plan, first = self._layout(query, key, _MASKS[mask])
        lay = plan.layout
        # A packed batch's documents change from batch to batch: they are agreed (and checked) every call.
        check = first or packed_seq_params is not None
        out = wallfacer_attention(query, key, value, self.cp_group, lay.team_size, causal=_MASKS[mask],
                                  softmax_scale=self.softmax_scale, layout=lay.layout, order=lay.order,
                                  kernel=self.wallfacer.kernel, backward=self.wallfacer.backward,
                                  team_qkv=resolve_team_qkv(self.wallfacer.team_qkv, lay.team_size,
                                                            self.recomputed),
                                  ulysses_size=plan.ulysses_size, check=check,
                                  deterministic=self.deterministic, packed_seq_params=packed_seq_params,
                                  positions=self.positions if check else None)
        return out.reshape(out.shape[0], -1) if thd else out.reshape(out.shape[0], out.shape[1], -1)


def _packed_error(params) -> str | None:
    if params is None:
        return None
    try:
        packing.from_packed_seq_params(params)
    except ValueError as e:
        text = str(e)
        return text if text.startswith("packed sequences") else f"packed_seq_params: {text}"
    return None


def watch_positions(model) -> None:
    """Let every WallFacerAttention of ``model`` (a GPTModel, or anything whose forward takes
    ``position_ids`` as its second argument or keyword) see the position ids of each forward: the first
    call of each shape (every call of a packed batch) then checks them against the layout on every CP
    rank (wallfacer_attention's ``positions``), so that a batch sharded in another layout raises instead of
    training on a wrong attention. Costs one comparison of this rank's s integers per checked call."""
    cores = [m for m in model.modules() if isinstance(m, WallFacerAttention)]

    def hook(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        for core in cores:
            core.positions = positions

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _layer_specs(spec) -> list:
    """The TransformerLayer specs inside a layer, block or multi-token-prediction block spec."""
    layers = list(getattr(spec, "layer_specs", None) or []) if not isinstance(spec, ModuleSpec) else [spec]
    out = []
    for layer in layers:
        inner = getattr(getattr(layer, "submodules", None), "transformer_layer", None)
        out.append(inner if inner is not None else layer)
    return out


def with_wallfacer(spec, wallfacer: WallFacerConfig | None = None):
    """A copy of a GPT layer spec, block spec or MTP block spec with WallFacerAttention as core attention.

    Every layer whose self-attention has a ``core_attention`` gets it (layers without attention, an
    IdentityOp, are left alone); multi-latent attention is refused.
    """
    spec = copy.deepcopy(spec)
    core = ModuleSpec(module=WallFacerAttention, params={} if wallfacer is None else {"wallfacer": wallfacer})
    for layer in _layer_specs(spec):
        attn = getattr(layer.submodules, "self_attention", None)
        if not isinstance(attn, ModuleSpec):
            continue
        if not hasattr(attn.submodules, "core_attention") or hasattr(attn.submodules, "linear_q_down_proj"):
            raise ValueError(f"{attn.module.__name__}: WallFacer replaces SelfAttention's core attention; "
                             f"multi-latent attention is not supported")
        attn.submodules.core_attention = core
    return spec


def get_gpt_layer_wallfacer_spec(wallfacer: WallFacerConfig | None = None, *, use_te: bool = False,
                                 **kwargs) -> ModuleSpec:
    """``get_gpt_layer_local_spec(**kwargs)`` (or the TE spec) with WallFacerAttention as core attention.

    ``wallfacer=None`` reads Megatron-LM's ``--wallfacer-*`` arguments when the layers are built. Under
    Megatron-LM's own training loop use ``python -m megatron_patches.megatron_lm``, which swaps the
    core attention of the spec Megatron-LM builds from the run's arguments.
    """
    if kwargs.get("multi_latent_attention"):
        raise ValueError("get_gpt_layer_wallfacer_spec: multi_latent_attention is not supported")
    base = get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec
    return with_wallfacer(base(**kwargs), wallfacer)
