"""``ds_plugins.initialize``: ``deepspeed.initialize`` with Parm switched on by the config.

    engine, optimizer, _, _ = ds_plugins.initialize(args=args, model=model, mpu=mpu,
                                                    model_parameters=model.parameters())

reads the ``"parm"`` section of the DeepSpeed config (from ``config``, ``config_params`` or
``args.deepspeed_config``, as DeepSpeed does). When it is enabled, every ``deepspeed.moe.layer.MoE`` in the
model is replaced by a ``ParmMoE`` holding the same modules and parameters (``setattr`` on its parent),
after checking every layer on every rank: its arguments (ds_plugins.inputs), experts divisible by ep,
tp x ep dividing the world, experts shardable when ESP > 1. The verdict and the section's values are
agreed over the world first (``comm.agree``), so a config or model that one rank alone gets wrong makes
every rank raise the same ValueError instead of leaving the others in ``deepspeed.initialize``'s
collectives. ``"timeout_s"`` sets ``comm.set_timeout``. Then ``deepspeed.initialize`` runs unchanged; it
keeps the ``"parm"`` section verbatim (parm.md §5.7) and sets up the ParmMoE layers through
``set_deepspeed_parallelism``; last, the engine's optimizer is made to save and load the states of
ESP-sharded experts in DeepSpeed's layout (ds_plugins.checkpoint).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import warnings
from collections.abc import Mapping

import deepspeed
import torch.distributed
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.moe.layer import MoE
from deepspeed.pipe import PipelineModule
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
from torch import nn

from commweave import comm
from ds_plugins import checkpoint, experts, inputs
from ds_plugins.config import ParmConfig
from ds_plugins.groups import check_layout
from ds_plugins.moe import ParmMoE, check_tutel


def _config_source(args, config, config_params):
    """The config DeepSpeed will use: ``config``, else ``config_params``, else ``args.deepspeed_config``."""
    if config is None:
        config = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None and getattr(args, name, None) is not None:
            config = getattr(args, name)
    return config


def check_moe(moe: MoE, world_size: int, tp: int) -> None:
    """Everything ParmMoE would reject later, checked on this rank alone (no collective)."""
    error = inputs.layer_args_error(**inputs.moe_args(moe))
    if error is not None:
        raise ValueError(error)
    check_layout(world_size, tp, moe.ep_size, moe.num_experts)
    check_tutel(moe.deepspeed_moe.use_tutel)  # True only with Tutel installed (DeepSpeed drops it otherwise)
    esp = tp if moe.enable_expert_tensor_parallelism else 1
    for expert in moe.deepspeed_moe.experts.deepspeed_experts:
        experts.check_shardable(expert, esp)


def _moe_layers(model: nn.Module) -> list:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, MoE) and not isinstance(m, ParmMoE)]


def swap_moe_layers(model: nn.Module, config: ParmConfig, world_size: int, tp: int) -> nn.Module:
    """Replace every DeepSpeed MoE in ``model`` by a ParmMoE; returns the model (itself, or its swap)."""
    found = _moe_layers(model)
    for _, moe in found:
        check_moe(moe, world_size, tp)
    for name, moe in found:
        if not name:
            return ParmMoE.from_moe(moe, config)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ParmMoE.from_moe(moe, config))
    return model


_inside = threading.local()
"""Set while ds_plugins.initialize runs deepspeed.initialize: the plain call's warning is not for it."""


def _parm_enabled(config) -> bool:
    """Whether a DeepSpeed config (dict or JSON file) has ``"parm": {"enabled": true}``; never raises (a
    file DeepSpeed cannot read is DeepSpeed's error to give)."""
    if isinstance(config, str | os.PathLike):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return False
    section = config.get("parm") if isinstance(config, Mapping) else None
    return isinstance(section, Mapping) and section.get("enabled") is True


def warn_if_parm_ignored(initialize):
    """``deepspeed.initialize`` wrapped (``import ds_plugins`` installs it): called directly with an enabled
    ``"parm"`` section, it warns on every rank that the MoE layers stay DeepSpeed's and how to switch Parm
    on, then runs unchanged. Only the call's own arguments are read: nothing communicates."""
    @functools.wraps(initialize)
    def plain(*args, **kwargs):
        if not getattr(_inside, "active", False):
            bound = inspect.signature(initialize).bind_partial(*args, **kwargs).arguments
            source = _config_source(bound.get("args"), bound.get("config"), bound.get("config_params"))
            if _parm_enabled(source):
                warnings.warn('the DeepSpeed config has "parm": {"enabled": true}, but '
                              "deepspeed.initialize does not read it: Parm is OFF and the MoE layers stay "
                              "deepspeed.moe.layer.MoE. "
                              "Call ds_plugins.initialize (the same arguments) to switch Parm on",
                              UserWarning, stacklevel=2)
        return initialize(*args, **kwargs)
    plain.parm_warns = True
    return plain


def install_plain_initialize_warning() -> None:
    """Wrap ``deepspeed.initialize`` with :func:`warn_if_parm_ignored`, once however often it is called
    (code that did ``from deepspeed import initialize`` before importing ds_plugins keeps the original)."""
    if not getattr(deepspeed.initialize, "parm_warns", False):
        deepspeed.initialize = warn_if_parm_ignored(deepspeed.initialize)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None, config_params=None):
    """``deepspeed.initialize`` (same arguments, same return value) with the ``"parm"`` section applied."""
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port, dist_init_required=dist_init_required)
    parm, error = ParmConfig(), None
    try:
        parm = ParmConfig.from_deepspeed(_config_source(args, config, config_params))
        if parm.timeout_s is not None:
            comm.set_timeout(parm.timeout_s)
        world = comm.size(torch.distributed.group.WORLD)
        # a PipelineModule brings its own mpu (its grid), which DeepSpeed's pipeline engine uses
        grid = model.mpu() if mpu is None and isinstance(model, PipelineModule) else mpu
        tp = bwc_tensor_model_parallel_world_size(grid)
        if parm.enabled and model is not None:
            for _, moe in _moe_layers(model):
                check_moe(moe, world, tp)
    except (ValueError, OSError) as e:
        error = f"ds_plugins.initialize: {e}"
    comm.agree(torch.distributed.group.WORLD, 'ds_plugins.initialize: the "parm" section', error,
               **parm.agreed_values())
    if parm.enabled and model is not None:
        model = swap_moe_layers(model, parm, world, tp)
    _inside.active = True
    try:
        out = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                   model_parameters=model_parameters, training_data=training_data,
                                   lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                                   dist_init_required=dist_init_required, collate_fn=collate_fn,
                                   config=config,
                                   mesh_param=mesh_param, config_params=config_params)
    finally:
        _inside.active = False
    if parm.enabled:
        checkpoint.install(out[0])  # optimizer states of sharded experts saved in DeepSpeed's layout too
    return out
