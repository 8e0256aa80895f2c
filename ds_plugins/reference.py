"""Pure-torch MoE dispatch and combine: the oracle of the fused kernels and their fallback.

Shape legend (DeepSpeed's einsum letters, ``deepspeed/moe/sharded_moe.py``):
    S tokens, M model dim, E experts, C capacity (slots per expert), k routes per token.

Routes come in DeepSpeed's sparse format, as ``TopKGate(..., sparse_routes)`` returns them::

    indices[k, S]    int32  expert of route j of token s; -1 marks a route dropped by the capacity
    locations[k, S]  int32  slot of that route in its expert's buffer (0 <= loc < C when live)
    gates[k, S]      fp32   weight of the route in the combine

The maths, for live routes (j, s) with (indices, locations)[j, s] = (e, c)::

    dispatch   X_ECM[e, c]   = x_SM[s]                         (slots no route claims are 0)
    combine    y_SM[s]       = Σ_j gates[j, s] · X_ECM[e, c]    (accumulated in fp32, fp64 for fp64)
    backward   dx_SM[s]      = Σ_j dX_ECM[e, c]
               dX_ECM[e, c]  = gates[j, s] · dy_SM[s]           (0 for empty slots)
               dgates[j, s]  = <dy_SM[s], X_ECM[e, c]>          (0 for dropped routes)

These are exactly ``_sparse_encode``/``_sparse_decode`` of deepspeed 0.19.8 (which park dropped routes
on a scratch zero row instead of skipping them). Each live (e, c) holds at most one route; the
callers in :mod:`ds_plugins.dispatch` check that, and every other precondition, before calling in.
"""

from __future__ import annotations

import torch


def accumulate_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype combine accumulates in: fp64 if any operand is fp64, otherwise fp32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _live_slots(indices: torch.Tensor, locations: torch.Tensor, capacity: int):
    """The live-route mask [k, S] and the flat slot e·C + c of every live route, in (j, s) order."""
    live = indices >= 0
    slots = indices[live].long() * capacity + locations[live].long()
    return live, slots


def dispatch(x: torch.Tensor, indices: torch.Tensor, locations: torch.Tensor, num_experts: int,
             capacity: int) -> torch.Tensor:
    """x[S, M] -> [E, C, M]: every live route copies its token into its slot; empty slots are 0."""
    k, num_tokens = indices.shape
    d_model = x.shape[1]
    live, slots = _live_slots(indices, locations, capacity)
    routed = x.unsqueeze(0).expand(k, num_tokens, d_model)[live]  # [L, M], L = live routes
    out = x.new_zeros(num_experts * capacity, d_model).index_put((slots,), routed)
    return out.view(num_experts, capacity, d_model)


def combine(expert_output: torch.Tensor, indices: torch.Tensor, locations: torch.Tensor,
            gates: torch.Tensor) -> torch.Tensor:
    """[E, C, M] -> y[S, M] = Σ_j gates[j, s] · expert_output[route (j, s)], accumulated in fp32."""
    num_experts, capacity, d_model = expert_output.shape
    k, num_tokens = indices.shape
    acc = accumulate_dtype(expert_output.dtype, gates.dtype)
    live, slots = _live_slots(indices, locations, capacity)
    rows = expert_output.reshape(num_experts * capacity, d_model)[slots]
    weighted = rows.to(acc) * gates[live].to(acc).unsqueeze(-1)  # [L, M]
    per_route = weighted.new_zeros(k, num_tokens, d_model).index_put((live,), weighted)
    # Summing the k routes of a token in order, in the accumulate dtype, is what _sparse_decode does.
    return per_route.sum(0).to(expert_output.dtype)


def dispatch_backward(grad_out: torch.Tensor, indices: torch.Tensor, locations: torch.Tensor,
                      num_tokens: int) -> torch.Tensor:
    """dX[E, C, M] -> dx[S, M] = Σ_j dX[route (j, s)] over live routes (a gather, summed in fp32)."""
    num_experts, capacity, d_model = grad_out.shape
    acc = accumulate_dtype(grad_out.dtype)
    live, slots = _live_slots(indices, locations, capacity)
    rows = grad_out.reshape(num_experts * capacity, d_model)[slots].to(acc)
    per_route = rows.new_zeros(indices.shape[0], num_tokens, d_model).index_put((live,), rows)
    return per_route.sum(0).to(grad_out.dtype)


def combine_backward(grad_out: torch.Tensor, expert_output: torch.Tensor, indices: torch.Tensor,
                     locations: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy[S, M] -> (dX[E, C, M], dgates[k, S]) from the formulas in the module docstring."""
    num_experts, capacity, d_model = expert_output.shape
    k, num_tokens = indices.shape
    acc = accumulate_dtype(expert_output.dtype, gates.dtype)
    live, slots = _live_slots(indices, locations, capacity)
    dy = grad_out.to(acc).unsqueeze(0).expand(k, num_tokens, d_model)[live]  # [L, M]
    grad_rows = (gates[live].to(acc).unsqueeze(-1) * dy).to(expert_output.dtype)
    grad_expert = expert_output.new_zeros(num_experts * capacity, d_model).index_put((slots,), grad_rows)
    rows = expert_output.reshape(num_experts * capacity, d_model)[slots].to(acc)
    grad_gates = torch.zeros(k, num_tokens, dtype=acc, device=gates.device)
    grad_gates[live] = (dy * rows).sum(-1)
    return grad_expert.view(num_experts, capacity, d_model), grad_gates.to(gates.dtype)
