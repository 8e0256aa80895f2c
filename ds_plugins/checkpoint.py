"""Checkpoints in DeepSpeed's own layout with ESP-sharded experts, so that they load with Parm on or off.

DeepSpeed's MoE (``engine.save_checkpoint``, deepspeed/runtime/engine.py ``_save_moe_checkpoint``) writes
every expert to its own file, ``layer_{l}_expert_{e}_mp_rank_{m}_model_states.pt``, keyed by the *global*
expert id e, from the layer's ``state_dict()``; the rest of the model goes to ``mp_rank_{m}_model_states.pt``
and the optimizer to ``expp_rank_{p}_mp_rank_{m}_optim_states.pt`` (ZeRO off) or
``..._zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt`` (ZeRO 1/2). Loading reads the expert files of the
global experts a rank holds now (``load_moe_state_dict``), which is why the EP size may change on load.
With the same model code and Parm off, every MP rank holds (and saves) whole experts.

With ESP = s a ParmMoE keeps block q of s of each sharded expert parameter (ds_plugins.experts). To write
and read exactly what DeepSpeed writes and reads:

- module: a state-dict hook on the layer all-gathers the blocks over ESP into the unsharded tensors
  (one all-gather per layer and dtype), and a load pre-hook keeps this rank's block of an unsharded
  tensor (no communication). ``state_dict(keep_vars=True)`` returns the Parameters themselves (blocks).
- optimizer, when the engine comes from ``ds_plugins.initialize``: a torch optimizer's per-parameter
  states (ZeRO off, fp32) get the same treatment through its state-dict hooks, and so do the fp32 master
  copies and their states under DeepSpeed's FP16_UnfusedOptimizer (ZeRO off, bf16 or fp16 with a torch
  optimizer: per-parameter copies, so a block is a slice of its copy; saved in Parm's blocks, they made
  stock DeepSpeed's load fail with "The size of tensor a (16) must match the size of tensor b (8)");
  ZeRO 1/2's flat partitions are rewritten between the two layouts by ds_plugins.zero_checkpoint. Other
  optimizer wrappers (FP16_Optimizer over a fused Adam: one flat fp32 vector per group; bf16 ZeRO-1's
  BF16_Optimizer; ZeRO-3) keep their own sharded layout, with a warning at set-up: their checkpoints load
  with Parm on and the same ESP size, or with ``load_optimizer_states=False``.

Saving is collective over each ESP group (an all-gather): every ESP rank calls ``state_dict()`` at the
same time, as ``engine.save_checkpoint`` (called on every rank) does; calling ``model.state_dict()`` on a
single rank of a model with sharded experts waits for its ESP peers.
"""

from __future__ import annotations

import functools

import torch
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.utils import logger
from torch import nn

from commweave import comm
from ds_plugins import experts, manifest, zero_checkpoint
from ds_plugins.experts import EspShard


def gather(tensors: list[torch.Tensor], tags: list[EspShard]) -> list[torch.Tensor]:
    """The unsharded tensors of this rank's blocks: one all-gather over ESP per dtype.

    Every tag has the same ESP group and size; every ESP rank passes tensors of the same shapes in the
    same order."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        picked = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in picked])
        s = tags[picked[0]].size
        every = flat.new_empty((s, flat.numel()))
        comm.all_gather(every, flat, tags[picked[0]].group)
        start = 0
        for i in picked:
            t, tag = tensors[i], tags[i]
            blocks = [every[q, start: start + t.numel()].view(t.shape) for q in range(s)]
            out[i] = torch.cat(blocks, dim=tag.dim)
            start += t.numel()
    return out


def block_of(value, shard: torch.Tensor, tag: EspShard):
    """``value`` loaded into the sharded ``shard``: this rank's block when ``value`` is unsharded, else
    ``value`` itself (a block already, or a wrong shape that the loader then reports)."""
    unsharded = torch.is_tensor(value) and list(value.shape) == tag.full_shape(shard.shape)
    if unsharded and value.shape != shard.shape:
        return tag.block(value).clone()
    return value


def register_layer_hooks(layer: nn.Module) -> None:
    """Make ``layer.state_dict()`` hold its experts unsharded and ``load_state_dict`` take them so."""
    sharded = experts.sharded_parameters(layer)

    def save(module, state_dict, prefix, local_metadata) -> None:
        keys = [prefix + name for name in sharded  # keep_vars=True: the Parameters themselves
                if prefix + name in state_dict and not isinstance(state_dict[prefix + name], nn.Parameter)]
        if keys:
            tags = [sharded[k[len(prefix):]].esp_shard for k in keys]
            for key, full in zip(keys, gather([state_dict[k] for k in keys], tags), strict=True):
                state_dict[key] = full

    def load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, p in sharded.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = block_of(state_dict[prefix + name], p, p.esp_shard)

    layer.register_state_dict_post_hook(save)
    layer.register_load_state_dict_pre_hook(load)


def _indexed_params(groups: list[list[nn.Parameter]], state_dict: dict) -> list[tuple[int, nn.Parameter]]:
    """(state-dict index, model parameter) of every sharded parameter, matched group by group as torch
    does; ``groups``: the model parameters behind the optimizer's groups, in its order."""
    pairs = []
    for params, saved in zip(groups, state_dict["param_groups"], strict=True):
        pairs += [(i, p) for i, p in zip(saved["params"], params, strict=True) if hasattr(p, "esp_shard")]
    return pairs


def _gathered_states(order: dict[int, int], groups, state_dict: dict, masters=None) -> tuple[dict, list]:
    """The optimizer ``state_dict``, and the fp32 ``masters`` [group][parameter] of bf16/fp16 parameters
    if given, with every sharded tensor unsharded: one all-gather per dtype. ``order``: the model's
    parameter order (DeepSpeed's MoE parameter groups come in an order that differs between processes; the
    ESP peers must gather the same tensors in the same order)."""
    state = {i: dict(s) for i, s in state_dict["state"].items()}
    masters = [list(m) for m in masters or []]
    # (order, key, parameter, the dict or list holding the tensor, its key or index there)
    picked = [(order[id(p)], key, p, state[i], key) for i, p in _indexed_params(groups, state_dict)
              for key, v in state.get(i, {}).items() if torch.is_tensor(v) and v.shape == p.shape]
    for held, params in zip(masters, groups if masters else [], strict=True):
        picked += [(order[id(p)], "", p, held, j) for j, p in enumerate(params) if hasattr(p, "esp_shard")]
    picked.sort(key=lambda c: c[:2])
    if picked:
        full = gather([held[at] for *_, held, at in picked], [p.esp_shard for _, _, p, _, _ in picked])
        for (*_, held, at), value in zip(picked, full, strict=True):
            held[at] = value
    return {**state_dict, "state": state}, masters


def _slice_optimizer_states(groups, state_dict: dict) -> dict:
    state = {i: dict(s) for i, s in state_dict["state"].items()}
    for i, p in _indexed_params(groups, state_dict):
        for key, value in state.get(i, {}).items():
            state[i][key] = block_of(value, p, p.esp_shard)
    return {**state_dict, "state": state}


def _gather_torch(order: dict[int, int], opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """ZeRO off, fp32: the torch optimizer's own state-dict hooks."""
    return _gathered_states(order, [g["params"] for g in opt.param_groups], state_dict)[0]


def _slice_torch(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    return _slice_optimizer_states([g["params"] for g in opt.param_groups], state_dict)


def _install_unfused(optimizer: FP16_UnfusedOptimizer, order: dict[int, int]) -> None:
    """bf16/fp16 with ZeRO off: DeepSpeed's FP16_UnfusedOptimizer keeps an fp32 copy of every parameter
    (``fp32_groups``, saved as is) under a torch optimizer of those copies; both are saved unsharded and
    loaded as blocks, through the wrapper's own state_dict / load_state_dict (it has no hooks)."""
    groups = optimizer.fp16_groups  # the model's parameters, aligned with fp32_groups and the inner groups
    state_dict, load_state_dict = optimizer.state_dict, optimizer.load_state_dict

    def save() -> dict:
        out = state_dict()
        inner, masters = _gathered_states(order, groups, out[OPTIMIZER_STATE_DICT], out["fp32_groups"])
        return {**out, OPTIMIZER_STATE_DICT: inner, "fp32_groups": masters}

    def load(saved: dict, load_optimizer_states: bool = True):
        masters = [[block_of(m, p, p.esp_shard) if hasattr(p, "esp_shard") else m
                    for m, p in zip(ms, ps, strict=True)]
                   for ms, ps in zip(saved["fp32_groups"], groups, strict=True)]
        saved = {**saved, "fp32_groups": masters}
        if load_optimizer_states:
            saved[OPTIMIZER_STATE_DICT] = _slice_optimizer_states(groups, saved[OPTIMIZER_STATE_DICT])
        return load_state_dict(saved, load_optimizer_states=load_optimizer_states)

    optimizer.state_dict, optimizer.load_state_dict = save, load


def install(engine) -> None:
    """Make the engine's optimizer state portable too (``ds_plugins.initialize`` calls it), and give its
    checkpoints a manifest of checksums, verified on load (ds_plugins.manifest)."""
    manifest.install(engine)
    if not any(hasattr(p, "esp_shard") for p in engine.module.parameters()):
        return
    optimizer = engine.optimizer
    order = {id(p): n for n, p in enumerate(engine.module.parameters())}
    if zero_checkpoint.supports(optimizer):
        zero_checkpoint.install(engine)
    elif isinstance(optimizer, torch.optim.Optimizer):  # ZeRO off, fp32: the basic optimizer itself
        optimizer.register_state_dict_post_hook(functools.partial(_gather_torch, order))
        optimizer.register_load_state_dict_pre_hook(_slice_torch)
    elif isinstance(optimizer, FP16_UnfusedOptimizer):  # ZeRO off, bf16/fp16
        _install_unfused(optimizer, order)
    elif optimizer is not None:
        logger.warning(f"parm: the optimizer {type(optimizer).__name__} keeps the states of ESP-sharded "
                       "experts in its own sharded layout: its checkpoints load with Parm on and the same "
                       "ESP size; elsewhere load them with load_optimizer_states=False (the model weights "
                       "are saved in DeepSpeed's layout)")
