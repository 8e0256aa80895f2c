"""Routes for the dispatch/combine tests, in DeepSpeed's sparse format (shape legend in
ds_plugins/reference.py): from DeepSpeed's own gates, and random ones with the corner cases the gates
rarely hit (every route of a token dropped, whole experts empty, a full buffer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating


@dataclass
class Routes:
    indices: torch.Tensor  # [k, S] int32, -1 = dropped
    locations: torch.Tensor  # [k, S] int32
    gates: torch.Tensor  # [k, S] fp32
    num_experts: int
    capacity: int

    @property
    def k(self) -> int:
        return self.indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[1]

    @property
    def dropped(self) -> int:
        return int((self.indices < 0).sum())


def gate_routes(k: int, num_tokens: int, num_experts: int, capacity_factor: float, seed: int,
                skew: float = 0.0) -> Routes:
    """Routes from DeepSpeed's gates (top1gating, top2gating, topkgating), sparse_routes=True.

    ``skew`` > 0 pushes the logits towards the first experts, so the last ones stay empty and the
    first ones overflow (dropped routes).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits -= skew * torch.arange(num_experts, dtype=torch.float32)
    torch.manual_seed(seed)  # the gates sample (RTS, Gumbel) from the global generator
    if k == 1:
        out = top1gating(logits, capacity_factor, 1, sparse_routes=True)
    elif k == 2:
        out = top2gating(logits, capacity_factor, 1, sparse_routes=True)
    else:
        out = topkgating(logits, k, capacity_factor, 1, sparse_routes=True)
    _, capacity, experts, indices, locations, gates, _ = out
    return Routes(indices, locations, gates.float(), int(experts), int(capacity))


def random_routes(k: int, num_tokens: int, num_experts: int, capacity: int, drop: float, seed: int,
                  empty_experts: int = 0) -> Routes:
    """Each live route gets a distinct random slot; a fraction ``drop`` of routes is dropped (their
    gates stay non-zero and their locations out of range: the ops must ignore both), and the last
    ``empty_experts`` receive nothing."""
    g = torch.Generator().manual_seed(seed)
    used = num_experts - empty_experts
    if k * num_tokens > used * capacity:
        raise ValueError(f"{k * num_tokens} routes do not fit in {used} experts x {capacity} slots")
    slots = torch.randperm(used * capacity, generator=g)[: k * num_tokens].view(k, num_tokens)
    indices = (slots // capacity).int()
    locations = (slots % capacity).int()
    dropped = torch.rand(k, num_tokens, generator=g) < drop
    indices[dropped] = -1
    locations[dropped] = capacity + 3
    gates = torch.rand(k, num_tokens, generator=g) + 0.1
    return Routes(indices, locations, gates, num_experts, capacity)
