"""A small model with DeepSpeed MoE layers, trained through the engine by plain DeepSpeed
(``deepspeed.initialize``: stock MoE, the same model code) or by Parm (``ds_plugins.initialize`` with a
``"parm"`` section), from the same initial weights on the same batches, so runs compare loss by loss.

    h = tanh(inp(x));  for each MoE layer: h = h + moe(h);  loss = mse(out(h), y) + 0.01 · Σ l_aux

Run on every rank of a world (tp = 2 by default, the README's layout: ESP = MP = 2). The batches depend on
the step and the data-parallel rank only, so a run resumed from a checkpoint sees what the original saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups
from torch import nn

import ds_plugins
from ds_plugins.experts import SwiGLU
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

S, M, H, E = 16, 8, 16, 8


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer: DeepSpeed's MoE arguments that the tests vary."""

    ep: int = 2
    expert: str = "mlp"  # "mlp": Linear, GELU, Linear; "swiglu": ds_plugins.experts.SwiGLU
    k: int = 2
    capacity_factor: float = 4.0
    noisy_gate_policy: str | None = None
    use_residual: bool = False
    drop_tokens: bool = True
    shard: bool = True  # enable_expert_tensor_parallelism

    def build(self) -> MoE:
        expert = SwiGLU(M, H) if self.expert == "swiglu" else mlp(M, H)
        return MoE(M, expert, num_experts=E, ep_size=self.ep, k=self.k, capacity_factor=self.capacity_factor,
                   eval_capacity_factor=self.capacity_factor, min_capacity=0, use_residual=self.use_residual,
                   noisy_gate_policy=self.noisy_gate_policy, drop_tokens=self.drop_tokens,
                   enable_expert_tensor_parallelism=self.shard, top2_2nd_expert_sampling=False)


class Net(nn.Module):
    def __init__(self, layers: tuple[LayerSpec, ...]) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(M, M), nn.Linear(M, M)
        self.moes = nn.ModuleList(spec.build() for spec in layers)

    def forward(self, x, y):
        h, aux = torch.tanh(self.inp(x)), 0.0
        for moe in self.moes:
            out, l_aux, _ = moe(h)
            h, aux = h + out, aux + l_aux
        return F.mse_loss(self.out(h), y) + 0.01 * aux


def use_layouts(tp: int, layers) -> object:
    """DeepSpeed's groups for every (ep size, sharded) of the model's layers, and no others (DeepSpeed names
    its optimizer files after the largest registered ep size): returns the mpu."""
    names = {f"ep_size_{ep}" for ep, _ in layers}
    for d in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
              "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        for name in set(getattr(groups, d)) - names:
            getattr(groups, d).pop(name)
    return [use_layout(tp, ep, shard) for ep, shard in sorted(set(layers))][-1].mpu


def config(stage: int, parm: dict | None = None, **extra) -> dict:
    out = {"train_micro_batch_size_per_gpu": S, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.02, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, **extra}
    if parm is not None:
        out["parm"] = parm
    return out


class AdamStepInGroups(torch.optim.Adam):
    """torch's Adam that also keeps a ``step`` in its parameter groups: DeepSpeed's elastic ZeRO checkpoints
    assert one (its own CPU Adam keeps it, but builds a C++ op first), torch's Adam keeps it in the state."""

    def __init__(self, params) -> None:
        dense = {"params": list(params), "name": "dense"}
        groups = split_params_into_different_moe_groups_for_optimizer(dense)
        super().__init__(groups, lr=0.02)
        for group in self.param_groups:
            group["step"] = 0


def build(layers: tuple[LayerSpec, ...], parm: dict | None, stage: int = 0, tp: int = 2, seed: int = 0,
          optimizer=None, **extra):
    """(engine, mpu): plain DeepSpeed when ``parm`` is None, else Parm with that section; ``optimizer``: a
    client optimizer callable instead of the config's Adam."""
    mpu = use_layouts(tp, [(spec.ep, spec.shard) for spec in layers])
    torch.manual_seed(seed)
    net = Net(layers)
    init = deepspeed.initialize if parm is None else ds_plugins.initialize
    cfg = config(stage, parm, **extra)
    if optimizer is not None:
        del cfg["optimizer"]
    engine, *_ = init(model=net, model_parameters=net.parameters(), mpu=mpu, config=cfg, optimizer=optimizer)
    return engine, mpu


def batch(step: int, mpu) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + mpu.get_data_parallel_rank())
    return torch.randn(S, M, generator=g), torch.randn(S, M, generator=g)


def train(engine, mpu, first: int, steps: int, seed: int = 7) -> list[float]:
    """Losses of steps ``first`` .. ``first + steps - 1``; the global RNG (the gates' noise) is seeded at the
    start, identically on every rank. The batches are cast to the model's dtype (bf16 under ``"bf16"``)."""
    torch.manual_seed(seed)
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for step in range(first, first + steps):
        loss = engine(*(t.to(dtype) for t in batch(step, mpu)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses
