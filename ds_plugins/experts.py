"""Expert sharding over ESP (parm.md §2.3 step 4, §9.3), and the protocol an expert implements to be sharded.

The protocol (:class:`ESPShardable`): an expert that can be split over s ESP ranks has two methods,

    esp_partition() -> {parameter name: dim}
        the parameters (names as in ``named_parameters``) split into s equal contiguous blocks along
        ``dim``; ESP rank q keeps block q. Parameters not named are replicated on the ESP ranks.
    esp_forward(x, esp_size) -> y_q
        the output of this rank's blocks, a partial sum: Σ_q y_q is the unsharded expert's output.
        Every ESP rank must get the full gradient of a replicated parameter (or the copies drift apart):
        an output bias b qualifies when added as b / s through :func:`shared_bias`; a replicated
        parameter inside the sharded computation would get a partial gradient, so shard it or leave it out.

and Parm does the rest: :func:`shard_` keeps rank q's blocks in place, the schedules reduce-scatter the
partial sums (the "deepspeed" schedule all-reduces them, as Megatron's row-parallel layer does), and the
checkpoint hooks (ds_plugins.checkpoint) gather the blocks back into the unsharded tensors DeepSpeed saves.
Two implementations ship:

    nn.Sequential(nn.Linear(M, H), <element-wise activation>, nn.Linear(H, M))      (adapted here)
        y = W2 · act(W1 · x + b1) + b2: W1, b1 split by rows (dim 0, column-parallel), W2 by columns
        (dim 1, row-parallel); y_q = W2_q · act(W1_q · x + b1_q) + b2 / s
    SwiGLU(M, H): the gated MLP of LLaMA / Mixtral experts (three projections, GLU family)
        y = W2 · (act(W1 · x) ⊙ (W3 · x)): W1 and W3 split by rows, W2 by columns;
        y_q = W2_q · (act(W1_q · x) ⊙ (W3_q · x))  (element-wise ⊙ and act keep rows apart)

Any other module with ``esp_partition`` and ``esp_forward`` works the same way; without them, an expert
runs with ESP = 1 and is refused with ESP > 1 (a ValueError naming the rule, before any collective).

The parameters are sharded *in place* (``param.data`` is replaced by its block), so the module keeps the
same Parameter objects: DeepSpeed's expert tags (``allreduce=False``, ``group_name``) and references held
by an optimizer stay valid. Each sharded parameter is tagged with its :class:`EspShard` (and Megatron's
``tensor_model_parallel``, ``partition_dim``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from ds_plugins import collectives

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity,
               nn.Hardswish, nn.Softplus, nn.ReLU6)


@runtime_checkable
class ESPShardable(Protocol):
    """An expert Parm can shard over ESP (see the module docstring)."""

    def esp_partition(self) -> dict[str, int]: ...

    def esp_forward(self, x: torch.Tensor, esp_size: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class EspShard:
    """The tag of a sharded parameter: block ``rank`` of ``size`` along ``dim``, over the ESP ``group``."""

    dim: int
    rank: int
    size: int
    group: object

    def full_shape(self, shard_shape: torch.Size) -> list[int]:
        shape = list(shard_shape)
        shape[self.dim] *= self.size
        return shape

    def block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the unsharded tensor ``full``."""
        n = full.shape[self.dim] // self.size
        return full.narrow(self.dim, self.rank * n, n)


class _SharedBias(torch.autograd.Function):
    """y + b / s forward; the gradient of b is the full sum: every ESP rank's partial output receives the
    whole output gradient (the reduce-scatter's dual is an all-gather, the all-reduce's the identity), so
    every copy of b gets the same full gradient, as Megatron's replicated bias does."""

    @staticmethod
    def forward(ctx, y, bias, esp_size):
        return y + bias / esp_size

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0), None


def shared_bias(y: torch.Tensor, bias: torch.Tensor | None, esp_size: int) -> torch.Tensor:
    """Add a replicated output bias to a partial sum (``bias`` None: ``y`` unchanged)."""
    return y if bias is None else _SharedBias.apply(y, bias, esp_size)


class SwiGLU(nn.Module):
    """A gated-MLP expert, y = w2(act(w1(x)) * w3(x)): SwiGLU with the default SiLU, GeGLU with nn.GELU(),
    GLU with nn.Sigmoid(). ``w1`` is the gate projection, ``w3`` the up projection, ``w2`` the down one."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: nn.Module | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=bias)
        self.act = nn.SiLU() if activation is None else activation
        if not isinstance(self.act, ELEMENTWISE):
            raise ValueError(f"SwiGLU activation={type(self.act).__name__} must be one of the element-wise "
                             f"{[a.__name__ for a in ELEMENTWISE]}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def esp_partition(self) -> dict[str, int]:
        dims = {"w1.weight": 0, "w3.weight": 0, "w2.weight": 1}
        if self.w1.bias is not None:
            dims.update({"w1.bias": 0, "w3.bias": 0})
        return dims

    def esp_forward(self, x: torch.Tensor, esp_size: int) -> torch.Tensor:
        y = F.linear(self.act(self.w1(x)) * self.w3(x), self.w2.weight)
        return shared_bias(y, self.w2.bias, esp_size)


class _SequentialMLP:
    """The protocol for a stock ``nn.Sequential(Linear(M, H), act, Linear(H, M))`` (which has no methods
    of its own to implement it)."""

    def __init__(self, expert: nn.Sequential) -> None:
        self.fc1, self.act, self.fc2 = expert

    def esp_partition(self) -> dict[str, int]:
        dims = {"0.weight": 0, "2.weight": 1}
        if self.fc1.bias is not None:
            dims["0.bias"] = 0
        return dims

    def esp_forward(self, x: torch.Tensor, esp_size: int) -> torch.Tensor:
        return shared_bias(F.linear(self.act(self.fc1(x)), self.fc2.weight), self.fc2.bias, esp_size)


def _sequential_reason(expert: nn.Module) -> str | None:
    if not isinstance(expert, nn.Sequential) or len(expert) != 3:
        return (f"it is a {type(expert).__name__}, neither an nn.Sequential of three modules nor a module "
                "with esp_partition() and esp_forward()")
    fc1, act, fc2 = expert
    if not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear):
        return "its first and last modules must be nn.Linear"
    if not isinstance(act, ELEMENTWISE):
        names = [a.__name__ for a in ELEMENTWISE]
        return f"its activation {type(act).__name__} is not one of the element-wise {names}"
    if fc1.out_features != fc2.in_features or fc1.in_features != fc2.out_features:
        return f"its layers {fc1.in_features}->{fc1.out_features}->{fc2.out_features} do not form M->H->M"
    return None


def protocol(expert: nn.Module) -> ESPShardable | None:
    """The expert's sharding protocol: itself, the adapter of a two-layer Sequential MLP, or None."""
    if isinstance(expert, ESPShardable):
        return expert
    return _SequentialMLP(expert) if _sequential_reason(expert) is None else None


def unsupported_reason(expert: nn.Module, esp_size: int = 1) -> str | None:
    """Why ``expert`` cannot be sharded over ``esp_size`` ranks, or None when it can."""
    impl = protocol(expert)
    if impl is None:
        return _sequential_reason(expert)
    params = dict(expert.named_parameters())
    for name, dim in impl.esp_partition().items():
        if name not in params:
            return f"esp_partition() names {name!r}, which is not one of its parameters {sorted(params)}"
        if params[name].dim() <= dim or params[name].shape[dim] % esp_size:
            return (f"its parameter {name} of shape {tuple(params[name].shape)} does not split into "
                    f"{esp_size} equal blocks along dim {dim}")
    return None


def check_shardable(expert: nn.Module, esp_size: int) -> None:
    """ValueError unless ``expert`` can run with ESP size ``esp_size``."""
    if esp_size == 1:
        return
    reason = unsupported_reason(expert, esp_size)
    if reason is not None:
        raise ValueError(
            f"expert {type(expert).__name__} cannot be sharded over ESP size {esp_size}: {reason}. Parm "
            "shards nn.Sequential(nn.Linear(M, H), <element-wise activation>, nn.Linear(H, M)), "
            "ds_plugins.experts.SwiGLU and any module with esp_partition() and esp_forward() "
            "(ds_plugins.experts.ESPShardable); for other experts set enable_expert_tensor_parallelism=False "
            "(ESP = 1)")


def shard_(expert: nn.Module, esp_rank: int, esp_size: int, esp_group=None) -> None:
    """Keep ESP rank ``esp_rank``'s blocks of the expert's parameters, in place, and tag them."""
    params = dict(expert.named_parameters())
    for name, dim in protocol(expert).esp_partition().items():
        p = params[name]
        tag = EspShard(dim, esp_rank, esp_size, esp_group)
        with torch.no_grad():
            p.data = tag.block(p.data).clone()
        p.esp_shard = tag
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    for m in expert.modules():  # keep nn.Linear's reported sizes in step with its weight
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape


def sharded_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The ESP-sharded parameters of ``module`` by name (those tagged by :func:`shard_`)."""
    return {name: p for name, p in module.named_parameters() if hasattr(p, "esp_shard")}


def ffn_size(expert: nn.Module, hidden_size: int) -> int:
    """The unsharded FFN size H of an expert, for the cost model: the rows of the first layer of a
    Sequential MLP or of SwiGLU's projections (times the ESP size when sharded), else parameters / 2M."""
    first = expert[0] if isinstance(expert, nn.Sequential) and len(expert) else getattr(expert, "w1", None)
    if isinstance(first, nn.Linear):
        tag = getattr(first.weight, "esp_shard", None)
        return first.out_features * (1 if tag is None else tag.size)
    return max(1, sum(p.numel() for p in expert.parameters()) // (2 * hidden_size))


def _run(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = expert(x)
    return out[0] if isinstance(out, tuple) else out  # DeepSpeed's Experts drops a returned bias too


def partial_sums(experts: nn.ModuleList, xs: Sequence[torch.Tensor], esp_size: int) -> list[torch.Tensor]:
    """Each local expert on its rows, xs[j] [F_j, M] -> [F_j, M]; partial sums over ESP when sharded."""
    if esp_size == 1:
        return [_run(expert, xe) for xe, expert in zip(xs, experts, strict=True)]
    return [protocol(expert).esp_forward(xe, esp_size) for xe, expert in zip(xs, experts, strict=True)]


def tensor_parallel(experts: nn.ModuleList, xs: Sequence[torch.Tensor], esp_group,
                    esp_size: int) -> list[torch.Tensor]:
    """The "deepspeed" schedule's expert: Megatron f (copy, all-reduce grads) -> shard -> g (all-reduce),
    on the rows it is given (the same on every ESP rank: the schedule routes identically on them)."""
    if esp_size == 1:
        return partial_sums(experts, xs, 1)
    outs = []
    for xe, expert in zip(xs, experts, strict=True):
        partial = protocol(expert).esp_forward(collectives.copy_to(xe, esp_group), esp_size)
        outs.append(collectives.reduce_from(partial, esp_group))
    return outs
