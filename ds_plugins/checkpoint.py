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
  states (ZeRO off) get the same treatment through its state-dict hooks; ZeRO 1/2's flat partitions are
  rewritten between the two layouts by ds_plugins.zero_checkpoint. Other optimizer wrappers (fp16/bf16
  without ZeRO, bf16 ZeRO-1's BF16_Optimizer, ZeRO-3) keep their own sharded layout, with a warning at
  set-up: their checkpoints load with Parm on and the same ESP size, or with ``load_optimizer_states=False``.

Saving is collective over each ESP group (an all-gather): every ESP rank calls ``state_dict()`` at the
same time, as ``engine.save_checkpoint`` (called on every rank) does; calling ``model.state_dict()`` on a
single rank of a model with sharded experts waits for its ESP peers.
"""

from __future__ import annotations

import functools

import torch
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


def _indexed_params(optimizer: torch.optim.Optimizer, state_dict: dict) -> list[tuple[int, nn.Parameter]]:
    """(state-dict index, parameter) of every sharded parameter, matched group by group as torch does."""
    pairs = []
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        pairs += [(i, p) for i, p in zip(saved["params"], group["params"], strict=True)
                  if hasattr(p, "esp_shard")]
    return pairs


def _gather_optimizer_states(order: dict[int, int], optimizer, state_dict: dict) -> dict:
    """``order``: the model's parameter order (DeepSpeed's MoE parameter groups come in an order that
    differs between processes; the ESP peers must gather the same tensors in the same order)."""
    picked = sorted(((i, key, p) for i, p in _indexed_params(optimizer, state_dict)
                     for key, v in state_dict["state"].get(i, {}).items()
                     if torch.is_tensor(v) and v.shape == p.shape), key=lambda c: (order[id(c[2])], c[1]))
    if not picked:
        return state_dict
    full = gather([state_dict["state"][i][key] for i, key, _ in picked], [p.esp_shard for _, _, p in picked])
    state = {i: dict(s) for i, s in state_dict["state"].items()}
    for (i, key, _), value in zip(picked, full, strict=True):
        state[i][key] = value
    return {**state_dict, "state": state}


def _slice_optimizer_states(optimizer, state_dict: dict) -> dict:
    state = {i: dict(s) for i, s in state_dict["state"].items()}
    for i, p in _indexed_params(optimizer, state_dict):
        for key, value in state.get(i, {}).items():
            state[i][key] = block_of(value, p, p.esp_shard)
    return {**state_dict, "state": state}


def install(engine) -> None:
    """Make the engine's optimizer state portable too (``ds_plugins.initialize`` calls it), and give its
    checkpoints a manifest of checksums, verified on load (ds_plugins.manifest)."""
    manifest.install(engine)
    if not any(hasattr(p, "esp_shard") for p in engine.module.parameters()):
        return
    optimizer = engine.optimizer
    if zero_checkpoint.supports(optimizer):
        zero_checkpoint.install(engine)
    elif isinstance(optimizer, torch.optim.Optimizer):  # ZeRO off, fp32: the basic optimizer itself
        order = {id(p): n for n, p in enumerate(engine.module.parameters())}
        optimizer.register_state_dict_post_hook(functools.partial(_gather_optimizer_states, order))
        optimizer.register_load_state_dict_pre_hook(_slice_optimizer_states)
    elif optimizer is not None:
        logger.warning(f"parm: the optimizer {type(optimizer).__name__} keeps the states of ESP-sharded "
                       "experts in its own sharded layout: its checkpoints load with Parm on and the same "
                       "ESP size; elsewhere load them with load_optimizer_states=False (the model weights "
                       "are saved in DeepSpeed's layout)")
