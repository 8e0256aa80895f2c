"""The pure-torch reference (ds_plugins.reference) against DeepSpeed's own sparse path.

The reference is the oracle of the kernels, so it is pinned here to deepspeed 0.19.8's
``_sparse_encode``/``_sparse_decode`` and their autograd, on routes from DeepSpeed's gates and random
ones, bit for bit where the maths allows it.
"""

import pytest
import torch
from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

from ds_plugins import reference
from tests.ds_plugins.moe_routes import gate_routes, random_routes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
M = 24

ROUTES = {
    "top1": lambda: gate_routes(1, 96, 8, 1.0, seed=1),
    "top2-overflow": lambda: gate_routes(2, 96, 8, 0.5, seed=2),
    "top4-skewed": lambda: gate_routes(4, 96, 8, 0.5, seed=3, skew=1.5),
    "random-k2": lambda: random_routes(2, 80, 6, 40, drop=0.2, seed=4, empty_experts=1),
    "random-k4-full": lambda: random_routes(4, 30, 4, 30, drop=0.0, seed=5),
}


def _deepspeed(routes, x, expert_output):
    slots = _route_slots(routes.indices, routes.locations, routes.num_experts, routes.capacity)
    encoded = _sparse_encode(x, slots, routes.num_experts, routes.capacity)
    flat = expert_output.reshape(-1, expert_output.shape[-1])
    decoded = _sparse_decode(flat, slots, routes.gates, routes.num_tokens)
    return encoded, decoded


def _inputs(routes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(routes.num_tokens, M, generator=g).to(dtype)
    expert_output = torch.randn(routes.num_experts, routes.capacity, M, generator=g).to(dtype)
    return x, expert_output


def test_route_cases_cover_drops_and_empty_experts():
    top2, skewed = ROUTES["top2-overflow"](), ROUTES["top4-skewed"]()
    assert top2.dropped > 0 and skewed.dropped > 0
    assert (skewed.indices == skewed.num_experts - 1).sum() == 0  # an expert nobody routes to
    full = ROUTES["random-k4-full"]()
    assert full.k * full.num_tokens == full.num_experts * full.capacity  # every slot taken


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTES)
def test_forward_matches_deepspeed_bit_for_bit(case, dtype):
    routes = ROUTES[case]()
    x, expert_output = _inputs(routes, dtype)
    encoded, decoded = _deepspeed(routes, x, expert_output)
    dispatched = reference.dispatch(x, routes.indices, routes.locations, routes.num_experts,
                                    routes.capacity)
    combined = reference.combine(expert_output, routes.indices, routes.locations, routes.gates)
    assert dispatched.dtype == combined.dtype == dtype
    assert torch.equal(dispatched, encoded)
    assert torch.equal(combined, decoded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTES)
def test_backward_oracle_matches_deepspeed_autograd(case, dtype):
    routes = ROUTES[case]()
    x, expert_output = _inputs(routes, dtype)
    x.requires_grad_(True)
    expert_output.requires_grad_(True)
    gates = routes.gates.clone().requires_grad_(True)
    slots = _route_slots(routes.indices, routes.locations, routes.num_experts, routes.capacity)
    g = torch.Generator().manual_seed(7)
    grad_encoded = torch.randn(routes.num_experts, routes.capacity, M, generator=g).to(dtype)
    grad_decoded = torch.randn(routes.num_tokens, M, generator=g).to(dtype)
    encoded = _sparse_encode(x, slots, routes.num_experts, routes.capacity)
    decoded = _sparse_decode(expert_output.view(-1, M), slots, gates, routes.num_tokens)
    torch.autograd.backward([encoded, decoded], [grad_encoded, grad_decoded])

    grad_x = reference.dispatch_backward(grad_encoded, routes.indices, routes.locations, routes.num_tokens)
    grad_expert, grad_gates = reference.combine_backward(grad_decoded, expert_output.detach(),
                                                         routes.indices, routes.locations, routes.gates)
    # DeepSpeed sums a token's routes by index_add in the input dtype; the oracle sums in fp32 and
    # rounds once. With at most two routes per token both round once.
    if routes.k <= 2 or dtype == torch.float32:
        torch.testing.assert_close(grad_x, x.grad, rtol=0, atol=0 if routes.k <= 2 else 1e-6)
    else:
        exact = reference.dispatch_backward(grad_encoded.double(), routes.indices, routes.locations,
                                            routes.num_tokens)
        assert (grad_x.double() - exact).abs().max() <= (x.grad.double() - exact).abs().max()
    assert torch.equal(grad_expert, expert_output.grad)
    torch.testing.assert_close(grad_gates, gates.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_autograd_is_the_backward_oracle(dtype):
    """The "torch" fallback differentiates the reference with autograd: same gradients as the oracle."""
    routes = ROUTES["top2-overflow"]()
    x, expert_output = _inputs(routes, dtype)
    x.requires_grad_(True)
    expert_output.requires_grad_(True)
    gates = routes.gates.clone().requires_grad_(True)
    dispatched = reference.dispatch(x, routes.indices, routes.locations, routes.num_experts, routes.capacity)
    combined = reference.combine(expert_output, routes.indices, routes.locations, gates)
    grad_dispatched, grad_combined = torch.randn_like(dispatched), torch.randn_like(combined)
    torch.autograd.backward([dispatched, combined], [grad_dispatched, grad_combined])
    assert torch.equal(x.grad, reference.dispatch_backward(grad_dispatched, routes.indices,
                                                           routes.locations, routes.num_tokens))
    grad_expert, grad_gates = reference.combine_backward(grad_combined, expert_output.detach(),
                                                         routes.indices, routes.locations, routes.gates)
    assert torch.equal(expert_output.grad, grad_expert)
    torch.testing.assert_close(gates.grad, grad_gates)


def test_accumulate_dtype():
    assert reference.accumulate_dtype(torch.bfloat16, torch.float32) == torch.float32
    assert reference.accumulate_dtype(torch.float16) == torch.float32
    assert reference.accumulate_dtype(torch.float32, torch.float64) == torch.float64
