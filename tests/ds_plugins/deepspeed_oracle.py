"""The oracles Parm is tested against: DeepSpeed's own MoE, run on the same weights and inputs.

- ``tp_oracle``: DeepSpeed's distributed MoE with ``enable_expert_tensor_parallelism`` and a Megatron-style
  tensor-parallel expert (column-parallel fc1, row-parallel fc2, built from megatron-core's own
  copy/reduce mappings) holding the same shards, as Megatron-DeepSpeed runs it. DeepSpeed asserts that
  the capacity divides by tp, so it cannot run when it does not (parm.md §2.8).
- ``local_oracle``: DeepSpeed's ``MOELayer`` in one process with every expert unsharded (ep 1, tp 1): the
  same gate and encode/decode on the full token set, valid for every capacity.

``gloo_gather_tokens`` is a test shim, not product code: DeepSpeed's ``_gather_tokens`` all-gathers an N-d
tensor into a flat buffer, which torch 2.13's gloo rejects (design/traps.md); the shim gathers into a
``[tp·d0, ...]`` buffer instead, the same maths.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe import mappings
from deepspeed.moe.experts import Experts
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import MOELayer, TopKGate
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn

from ds_plugins.groups import ModelParallelUnit


def gloo_gather_tokens(input_, dim=0):
    mpu = groups.mpu
    tp = bwc_tensor_model_parallel_world_size(mpu)
    if tp == 1:
        return input_
    input_ = input_.contiguous()
    buf = input_.new_empty((tp * input_.shape[0], *input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(buf, input_, group=bwc_tensor_model_parallel_group(mpu))
    return torch.cat(buf.chunk(tp), dim=dim).contiguous()


mappings._gather_tokens = gloo_gather_tokens


@dataclass
class Weights:
    """Full weights of E experts (fc1 [H, M], fc2 [M, H]) and the gate, identical on every rank."""

    wg: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    @classmethod
    def random(cls, e: int, m: int, h: int, seed: int = 0) -> Weights:
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(e, m, generator=g), torch.randn(e, h, m, generator=g) / m ** 0.5,
                   torch.randn(e, h, generator=g) * 0.1, torch.randn(e, m, h, generator=g) / h ** 0.5,
                   torch.randn(e, m, generator=g) * 0.1)


def mlp(m: int, h: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(m, h), nn.GELU(), nn.Linear(h, m))


class TensorParallelMLP(nn.Module):
    """Megatron's ParallelMLP as Megatron-DeepSpeed builds an expert: fc1 by columns, fc2 by rows, AR."""

    def __init__(self, m: int, h: int, tp: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(m, h // tp), nn.Linear(h // tp, m)

    def forward(self, x):
        group = groups.mpu.get_tensor_model_parallel_group()  # Megatron reads its global state the same way
        x = copy_to_tensor_model_parallel_region(x, group)
        y = reduce_from_tensor_model_parallel_region(F.linear(F.gelu(self.fc1(x)), self.fc2.weight), group)
        return y + self.fc2.bias


@dataclass
class Layout:
    tp: int
    ep: int
    shard: bool
    mpu: object
    saved: dict


_LAYOUTS: dict[tuple, Layout] = {}
_DICTS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
          "_EXPERT_DATA_PARALLEL_GROUP_RANKS")


def use_layout(tp: int, ep: int, shard: bool = True) -> Layout:
    """Make DeepSpeed's global group state that of (tp, ep); groups are created once per process."""
    deepspeed.init_distributed(dist_backend="gloo")
    name = f"ep_size_{ep}"
    for d in _DICTS:
        getattr(groups, d).pop(name, None)
    key = (tp, ep, shard and tp > 1)
    if key not in _LAYOUTS:
        groups.mpu = ModelParallelUnit(tp) if tp > 1 else None
        if key[2]:
            groups._create_expert_data_and_model_parallel(ep, mpu=groups.mpu)
        else:
            groups._create_expert_and_data_parallel(ep)
        _LAYOUTS[key] = Layout(tp, ep, key[2], groups.mpu, {d: getattr(groups, d)[name] for d in _DICTS})
    lay = _LAYOUTS[key]
    groups.mpu = lay.mpu
    groups.expert_tensor_parallel_world_size = tp if lay.shard else 1
    for d in _DICTS:
        getattr(groups, d)[name] = lay.saved[d]
    return lay


def tp_rank() -> int:
    return 0 if groups.mpu is None else groups.mpu.get_tensor_model_parallel_rank()


def load_parm(layer, w: Weights) -> None:
    """Full weights into a (not yet sharded) ParmMoE whose experts are ``mlp(M, H)``."""
    ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
    with torch.no_grad():
        layer.gate.wg.weight.copy_(w.wg)
        for j, expert in enumerate(layer.local_experts):
            e = ep_rank * layer.num_local_experts + j
            expert[0].weight.copy_(w.w1[e])
            expert[0].bias.copy_(w.b1[e])
            expert[2].weight.copy_(w.w2[e])
            expert[2].bias.copy_(w.b2[e])


def tp_oracle(w: Weights, tp: int, ep: int, **moe_kwargs) -> MoE:
    m, h = w.w1.shape[2], w.w1.shape[1]
    expert = TensorParallelMLP(m, h, tp) if tp > 1 else mlp(m, h)
    layer = MoE(m, expert, num_experts=w.w1.shape[0], ep_size=ep,
                enable_expert_tensor_parallelism=True, **moe_kwargs)
    layer.set_deepspeed_parallelism()
    ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
    q, hs = tp_rank(), h // tp
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(w.wg)
        for j, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = ep_rank * layer.num_local_experts + j
            fc1, fc2 = (expert.fc1, expert.fc2) if tp > 1 else (expert[0], expert[2])
            fc1.weight.copy_(w.w1[e, q * hs:(q + 1) * hs])
            fc1.bias.copy_(w.b1[e, q * hs:(q + 1) * hs])
            fc2.weight.copy_(w.w2[e, :, q * hs:(q + 1) * hs])
            fc2.bias.copy_(w.b2[e])
    return layer


class LocalOracle(nn.Module):
    """DeepSpeed's MOELayer with all E unsharded experts in this process (no groups, no mpu)."""

    def __init__(self, w: Weights, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, noisy_gate_policy=None,
                 drop_tokens: bool = True, use_rts: bool = True,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        e, h, m = w.w1.shape
        gate = TopKGate(m, e, k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy,
                        drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.moe = MOELayer(gate, Experts(mlp(m, h), e, "local_oracle"), "local_oracle", 1, e)
        with torch.no_grad():
            gate.wg.weight.copy_(w.wg)
            for i, expert in enumerate(self.moe.experts.deepspeed_experts):
                expert[0].weight.copy_(w.w1[i])
                expert[0].bias.copy_(w.b1[i])
                expert[2].weight.copy_(w.w2[i])
                expert[2].bias.copy_(w.b2[i])

    def forward(self, x):
        with _no_parallelism():
            out = self.moe(x, None)
        return out, self.moe.l_aux, self.moe.exp_counts

    def expert(self, e: int) -> nn.Sequential:
        return self.moe.experts.deepspeed_experts[e]


@contextlib.contextmanager
def _no_parallelism():
    saved = groups.mpu, groups.expert_tensor_parallel_world_size
    groups.mpu, groups.expert_tensor_parallel_world_size = None, 1
    try:
        yield
    finally:
        groups.mpu, groups.expert_tensor_parallel_world_size = saved
