"""What a Parm layer refuses, decided on each rank alone: the layer's arguments and each forward's input.

The functions here return the reason as text (None when all is well) instead of raising, because a rank
that raised on its own would leave the other ranks of its layer waiting in their next collective. The
callers spread the verdict first, so that every rank raises the same ValueError before any collective
whose sizes depend on the input:

- ``ParmMoE(...)``: the constructor raises at once (no collective has been issued yet, on any rank);
- ``ds_plugins.initialize``: the ``"parm"`` section and every MoE layer, agreed over the world
  (``comm.agree``) before ``deepspeed.initialize`` runs;
- ``ParmMoE.set_deepspeed_parallelism``: the settings, agreed over the layer's MP and EP groups
  (ds_plugins.agreement.settings);
- ``ParmMoE.forward``: the input, carried by the token-count agreement (ds_plugins.agreement.tokens), or
  where the forward is sync-free by the header of its fill exchange (ds_plugins.schedules.refuse).

Every message names the argument, the value and the rule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
_FLAGS = ("use_residual", "drop_tokens", "use_rts", "enable_expert_tensor_parallelism",
          "top2_2nd_expert_sampling")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def layer_args_error(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                     min_capacity, noisy_gate_policy, **flags) -> str | None:
    """The first rule DeepSpeed's MoE arguments break (``flags``: the booleans of :data:`_FLAGS`), or None.

    DeepSpeed's own MoE accepts several of these silently (k = 0, a negative or NaN capacity factor,
    ``drop_tokens="no"``) or fails later with an error that names no argument (k > num_experts,
    num_experts = 0, a hidden size the expert does not take).
    """
    if not _int(hidden_size) or hidden_size < 1:
        return f"hidden_size={hidden_size!r} must be an integer >= 1"
    if not isinstance(expert, nn.Module):
        return (f"expert={type(expert).__name__} must be a torch.nn.Module (one expert, copied num_experts "
                "times)")
    if not _int(num_experts) or num_experts < 1:
        return f"num_experts={num_experts!r} must be an integer >= 1"
    if not _int(ep_size) or ep_size < 1 or num_experts % ep_size:
        return (f"num_experts={num_experts} must be divisible by ep_size={ep_size!r} "
                "(every EP rank holds num_experts / ep_size experts)")
    if not _int(k) or not 1 <= k <= num_experts:
        return f"k={k!r} must be an integer in [1, num_experts={num_experts}] (experts per token)"
    for name, cf in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        if isinstance(cf, bool) or not isinstance(cf, int | float) or not (math.isfinite(cf) and cf > 0):
            return f"{name}={cf!r} must be a finite number > 0 (the expert capacity scales with it)"
    if not _int(min_capacity) or min_capacity < 0:
        return f"min_capacity={min_capacity!r} must be an integer >= 0"
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        return f"noisy_gate_policy={noisy_gate_policy!r} is not one of {NOISY_GATE_POLICIES}"
    for name, value in flags.items():
        if not isinstance(value, bool):
            return f"{name}={value!r} must be True or False"
    first = expert[0] if isinstance(expert, nn.Sequential) and len(expert) else None
    if isinstance(first, nn.Linear) and first.in_features != hidden_size:
        return (f"hidden_size={hidden_size} but the expert's first layer takes {first.in_features} features: "
                "they must be equal")
    return None


def moe_args(moe) -> dict:
    """The constructor arguments of a built ``deepspeed.moe.layer.MoE``, for :func:`layer_args_error`."""
    gate = moe.deepspeed_moe.gate
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    return dict(hidden_size=gate.wg.in_features, expert=experts[0] if len(experts) else None,
                num_experts=moe.num_experts, ep_size=moe.ep_size, k=gate.k,
                capacity_factor=gate.capacity_factor,
                eval_capacity_factor=gate.eval_capacity_factor, min_capacity=gate.min_capacity,
                noisy_gate_policy=gate.noisy_gate_policy, use_residual=moe.use_residual,
                drop_tokens=gate.drop_tokens, use_rts=gate.use_rts,
                enable_expert_tensor_parallelism=moe.enable_expert_tensor_parallelism,
                top2_2nd_expert_sampling=gate.top2_2nd_expert_sampling)


def forward_error(layer, hidden_states, used_token) -> str | None:
    """Why this rank's input to ``layer.forward`` is refused, or None.

    hidden_states: any [..., M] floating-point tensor with M = the layer's hidden size, on the layer's
    device, in the experts' dtype (unless autocast is on). used_token: None or [S], S = the token count.
    """
    gate_weight = layer.gate.wg.weight
    hidden = gate_weight.shape[1]
    if not isinstance(hidden_states, torch.Tensor):
        return f"hidden_states must be a torch.Tensor [..., {hidden}], got {type(hidden_states).__name__}"
    shape = tuple(hidden_states.shape)
    if hidden_states.dim() < 1 or shape[-1] != hidden:
        return f"hidden_states has shape {shape}: its last dimension must be the layer's hidden_size {hidden}"
    if not hidden_states.is_floating_point():
        return f"hidden_states has dtype {hidden_states.dtype}: it must be a floating-point tensor"
    if hidden_states.device != gate_weight.device:
        return (f"hidden_states is on {hidden_states.device}, the layer on {gate_weight.device}: "
                "use one device")
    expert_weight = next(iter(layer.local_experts.parameters()), None)
    autocast = torch.is_autocast_enabled(hidden_states.device.type)
    if expert_weight is not None and not autocast and hidden_states.dtype != expert_weight.dtype:
        return (f"hidden_states has dtype {hidden_states.dtype}, the experts {expert_weight.dtype}: cast the "
                "input or the model (or run under torch.autocast)")
    tokens = math.prod(shape[:-1])
    tensor = isinstance(used_token, torch.Tensor)
    if used_token is not None and (not tensor or tuple(used_token.shape) != (tokens,)):
        got = tuple(used_token.shape) if tensor else type(used_token).__name__
        return f"used_token has shape {got}: it must be None or [S] = [{tokens}], one entry per token"
    return None
