"""Expert sharding over ESP (parm.md §2.3 step 4, §9.3): a plain two-layer MLP, split Megatron-style.

    y = W2 · act(W1 · x + b1) + b2,   W1 [H, M], W2 [M, H]
    ESP rank q of s keeps W1[qH/s:(q+1)H/s, :], b1[qH/s:(q+1)H/s] (column-parallel first layer) and
    W2[:, qH/s:(q+1)H/s] (row-parallel second layer), and computes the partial sum
    y_q = W2_q · act(W1_q · x + b1_q) + b2 / s,   y = Σ_q y_q.

Parm reduce-scatters the partial sums (no all-reduce inside the expert); the "deepspeed" schedule
all-reduces them, as a Megatron ``RowParallelLinear`` does. b2 is replicated on the ESP ranks: each adds
b2 / s, and its gradient is the sum of the full output gradient (which every ESP rank receives, the
reduce-scatter's dual being an all-gather), so every copy gets the same full gradient, as Megatron's
replicated bias does.

The parameters are sharded *in place* (``param.data`` is replaced by its slice), so the module keeps the
same Parameter objects: DeepSpeed's expert tags (``allreduce=False``, ``group_name``) and references
held by an optimizer stay valid. Any other expert module works when ESP = 1 and is refused with ESP > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ds_plugins import collectives

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity,
               nn.Hardswish, nn.Softplus, nn.ReLU6)


def unsupported_reason(expert: nn.Module) -> str | None:
    """Why ``expert`` cannot be sharded over ESP, or None when it can."""
    if not isinstance(expert, nn.Sequential) or len(expert) != 3:
        return f"it is a {type(expert).__name__}, not an nn.Sequential of three modules"
    fc1, act, fc2 = expert
    if not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear):
        return "its first and last modules must be nn.Linear"
    if not isinstance(act, ELEMENTWISE):
        names = [a.__name__ for a in ELEMENTWISE]
        return f"its activation {type(act).__name__} is not one of the element-wise {names}"
    if fc1.out_features != fc2.in_features or fc1.in_features != fc2.out_features:
        return f"its layers {fc1.in_features}->{fc1.out_features}->{fc2.out_features} do not form M->H->M"
    return None


def check_shardable(expert: nn.Module, esp_size: int) -> None:
    """ValueError unless ``expert`` can run with ESP size ``esp_size``."""
    if esp_size == 1:
        return
    reason = unsupported_reason(expert)
    if reason is None and expert[0].out_features % esp_size:
        reason = f"its FFN size {expert[0].out_features} is not divisible by the ESP size {esp_size}"
    if reason is not None:
        raise ValueError(
            f"expert {type(expert).__name__} cannot be sharded over ESP size {esp_size}: {reason}. "
            "Parm shards "
            "nn.Sequential(nn.Linear(M, H), <element-wise activation>, nn.Linear(H, M)) by columns and rows; "
            "for other experts set enable_expert_tensor_parallelism=False (ESP = 1)")


def shard_(expert: nn.Sequential, esp_rank: int, esp_size: int) -> None:
    """Keep ESP rank ``esp_rank``'s slice of the expert's parameters, in place."""
    fc1, _, fc2 = expert
    h = fc1.out_features // esp_size
    rows = slice(esp_rank * h, (esp_rank + 1) * h)
    with torch.no_grad():
        fc1.weight.data = fc1.weight.data[rows].clone()
        if fc1.bias is not None:
            fc1.bias.data = fc1.bias.data[rows].clone()
        fc2.weight.data = fc2.weight.data[:, rows].clone()
    fc1.out_features = fc2.in_features = h
    for p, dim in ((fc1.weight, 0), (fc1.bias, 0), (fc2.weight, 1)):
        if p is not None:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


class _SharedBias(torch.autograd.Function):
    """y + b / s forward; the gradient of b is the full sum (see the module docstring)."""

    @staticmethod
    def forward(ctx, y, bias, esp_size):
        return y + bias / esp_size

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0), None


def _mlp_partial(expert: nn.Sequential, x: torch.Tensor, esp_size: int) -> torch.Tensor:
    fc1, act, fc2 = expert
    y = F.linear(act(fc1(x)), fc2.weight)
    return y if fc2.bias is None else _SharedBias.apply(y, fc2.bias, esp_size)


def _run(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = expert(x)
    return out[0] if isinstance(out, tuple) else out  # DeepSpeed's Experts drops a returned bias too


def partial_sums(experts: nn.ModuleList, xs: Sequence[torch.Tensor], esp_size: int) -> list[torch.Tensor]:
    """Each local expert on its rows, xs[j] [F_j, M] -> [F_j, M]; partial sums over ESP when sharded."""
    if esp_size == 1:
        return [_run(expert, xe) for xe, expert in zip(xs, experts, strict=True)]
    return [_mlp_partial(expert, xe, esp_size) for xe, expert in zip(xs, experts, strict=True)]


def tensor_parallel(experts: nn.ModuleList, xs: Sequence[torch.Tensor], esp_group,
                    esp_size: int) -> list[torch.Tensor]:
    """The "deepspeed" schedule's expert: Megatron f (copy, all-reduce grads) -> shard -> g (all-reduce),
    on the rows it is given (the same on every ESP rank: the schedule routes identically on them)."""
    if esp_size == 1:
        return partial_sums(experts, xs, 1)
    outs = []
    for xe, expert in zip(xs, experts, strict=True):
        fc1, act, fc2 = expert
        y = collectives.reduce_from(F.linear(act(fc1(collectives.copy_to(xe, esp_group))), fc2.weight),
                                    esp_group)
        outs.append(y if fc2.bias is None else y + fc2.bias)
    return outs
