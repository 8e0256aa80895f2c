"""The fused dispatch/combine kernels (ds_plugins._C, via ds_plugins.dispatch) against the pure-torch
reference and DeepSpeed's sparse path: forward, backward, low-precision accuracy, gradcheck in fp64,
on both CPU builds (baseline and AVX2). CUDA cases run the same checks on a GPU (marked `cuda`).
Input checks and the fallback are in test_dispatch_inputs.py."""


import os
import subprocess
import sys

import pytest
import torch
from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

from ds_plugins import dispatch as ops
from ds_plugins import reference
from tests.ds_plugins.moe_routes import Routes, gate_routes, random_routes

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# 40: rows that are no multiple of the vector widths (the loops' tails run); 64: rows of whole cache lines
# (the CPU kernels stream them out with non-temporal stores).
D_MODELS = [40, 64]

ROUTES = {
    "top1": lambda: gate_routes(1, 128, 8, 1.0, seed=11),
    "top2-overflow": lambda: gate_routes(2, 128, 8, 0.5, seed=12),
    "top4-skewed": lambda: gate_routes(4, 128, 8, 0.5, seed=13, skew=1.5),
    "random-k2": lambda: random_routes(2, 100, 6, 50, drop=0.3, seed=14, empty_experts=2),
    "random-k4-full": lambda: random_routes(4, 32, 4, 32, drop=0.0, seed=15),
}


def _to(routes: Routes, device) -> Routes:
    return Routes(routes.indices.to(device), routes.locations.to(device), routes.gates.to(device),
                  routes.num_experts, routes.capacity)


def _data(routes: Routes, dtype, device, d_model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(routes.num_tokens, d_model, generator=g).to(device, dtype)
    expert_output = torch.randn(routes.num_experts, routes.capacity, d_model, generator=g).to(device, dtype)
    return x, expert_output


def _expect_kernels(device):
    assert ops.backend(device) == device, (
        f"the {device} kernels are not active ({ops.backend(device)!r}): build ds_plugins._C first")


def test_backend_names_the_path():
    _expect_kernels("cpu")
    assert ops.backend() in ("cpu", "cuda")
    assert ops.backend("meta") == "torch"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d_model", D_MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTES)
def test_forward_matches_reference_and_deepspeed(case, dtype, d_model, device):
    _expect_kernels(device)
    routes = _to(ROUTES[case](), device)
    x, expert_output = _data(routes, dtype, device, d_model=d_model)
    dispatched = ops.dispatch(x, routes.indices, routes.locations, routes.num_experts, routes.capacity)
    combined = ops.combine(expert_output, routes.indices, routes.locations, routes.gates)
    # The oracles run on the CPU, where torch sums the k routes in order (a GPU reduction may pair them).
    routes, x, expert_output = _to(routes, "cpu"), x.cpu(), expert_output.cpu()
    slots = _route_slots(routes.indices, routes.locations, routes.num_experts, routes.capacity)
    # dispatch is a permutation: bit-exact. combine rounds each gate product, then sums the routes in
    # order in fp32 (fp64), exactly as _sparse_decode does: bit-exact too.
    assert torch.equal(dispatched.cpu(), _sparse_encode(x, slots, routes.num_experts, routes.capacity))
    assert torch.equal(combined.cpu(), _sparse_decode(expert_output.view(-1, d_model), slots, routes.gates,
                                                      routes.num_tokens))
    assert torch.equal(combined.cpu(), reference.combine(expert_output, routes.indices, routes.locations,
                                                         routes.gates))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d_model", D_MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTES)
def test_backward_matches_the_oracle(case, dtype, d_model, device):
    _expect_kernels(device)
    routes = _to(ROUTES[case](), device)
    x, expert_output = _data(routes, dtype, device, d_model=d_model)
    x.requires_grad_(True)
    expert_output.requires_grad_(True)
    gates = routes.gates.clone().requires_grad_(True)
    dispatched = ops.dispatch(x, routes.indices, routes.locations, routes.num_experts, routes.capacity)
    combined = ops.combine(expert_output, routes.indices, routes.locations, gates)
    grad_dispatched, grad_combined = torch.randn_like(dispatched), torch.randn_like(combined)
    torch.autograd.backward([dispatched, combined], [grad_dispatched, grad_combined])

    routes = _to(routes, "cpu")  # oracles on the CPU, as above
    assert torch.equal(x.grad.cpu(), reference.dispatch_backward(grad_dispatched.cpu(), routes.indices,
                                                                 routes.locations, routes.num_tokens))
    grad_expert, grad_gates = reference.combine_backward(grad_combined.cpu(), expert_output.detach().cpu(),
                                                         routes.indices, routes.locations, routes.gates)
    assert torch.equal(expert_output.grad.cpu(), grad_expert)
    # A dot product over M: the kernel's vectorised order differs from torch's sum.
    tol = {torch.float64: 1e-12}.get(dtype, 1e-5)
    torch.testing.assert_close(gates.grad.cpu(), grad_gates, rtol=tol, atol=tol)
    assert (gates.grad.cpu()[routes.indices < 0] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_combine_is_as_accurate_as_fp32_accumulation_allows(dtype, device):
    """flash-attn's rule, err(kernel) <= 2 err(plain torch in low precision), both against fp64; here
    the kernel must beat plain low-precision torch outright and stay within half an ulp of output."""
    _expect_kernels(device)
    routes = _to(gate_routes(4, 256, 8, 1.0, seed=21), device)
    _, expert_output = _data(routes, dtype, device, d_model=256)
    exact = reference.combine(expert_output.double(), routes.indices, routes.locations, routes.gates.double())
    kernel = ops.combine(expert_output, routes.indices, routes.locations, routes.gates)
    live = routes.indices >= 0
    rows = expert_output.view(-1, 256)[(routes.indices.long() * routes.capacity + routes.locations)[live]]
    plain = torch.zeros(routes.k, routes.num_tokens, 256, dtype=dtype, device=device)
    plain[live] = rows * routes.gates[live].to(dtype).unsqueeze(-1)
    plain = plain.sum(0, dtype=dtype)
    err_kernel = (kernel.double() - exact).abs().max()
    assert err_kernel <= (plain.double() - exact).abs().max()
    assert err_kernel <= 0.5 * torch.finfo(dtype).eps * exact.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    _expect_kernels(device)
    routes = _to(random_routes(2, 64, 4, 40, drop=0.2, seed=31), device)
    x, expert_output = _data(routes, torch.float32, device, d_model=80)
    x, expert_output = x[:, ::2], expert_output.transpose(0, 1).contiguous().transpose(0, 1)[..., ::2]
    indices = torch.stack([routes.indices, routes.indices], -1)[..., 0]
    locations = routes.locations.t().contiguous().t()
    gates = torch.stack([routes.gates, routes.gates], -1)[..., 1]
    for t in (x, expert_output, indices, locations, gates):
        assert not t.is_contiguous()
    assert torch.equal(ops.dispatch(x, indices, locations, routes.num_experts, routes.capacity),
                       reference.dispatch(x.contiguous(), routes.indices, routes.locations,
                                          routes.num_experts, routes.capacity))
    assert torch.equal(ops.combine(expert_output, indices, locations, gates),
                       reference.combine(expert_output.contiguous(), routes.indices, routes.locations,
                                         routes.gates))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gradcheck_fp64_through_the_kernels(k, device):
    _expect_kernels(device)
    routes = _to(random_routes(k, 12, 4, 3 * k, drop=0.25, seed=40 + k), device)
    x, expert_output = _data(routes, torch.float64, device, d_model=5)
    gates = routes.gates.double()

    def dispatch_then_combine(x, expert_output, gates):
        dispatched = ops.dispatch(x, routes.indices, routes.locations, routes.num_experts, routes.capacity)
        combined = ops.combine(expert_output * dispatched, routes.indices, routes.locations, gates)
        return dispatched, combined

    inputs = tuple(t.clone().requires_grad_(True) for t in (x, expert_output, gates))
    assert torch.autograd.gradcheck(dispatch_then_combine, inputs)


def test_empty_shapes():
    _expect_kernels("cpu")
    routes = random_routes(2, 0, 3, 0, drop=0.0, seed=0)
    out = ops.dispatch(torch.zeros(0, 8), routes.indices, routes.locations, 3, 0)
    assert out.shape == (3, 0, 8)
    assert ops.combine(out, routes.indices, routes.locations, routes.gates).shape == (0, 8)
    dropped = torch.full((1, 4), -1, dtype=torch.int32)
    y = ops.combine(torch.ones(2, 0, 8), dropped, dropped, torch.ones(1, 4))
    assert torch.equal(y, torch.zeros(4, 8))


def test_cpu_isa_is_the_one_asked_for():
    _expect_kernels("cpu")
    assert ops._C.CPU_ISA in ("base", "avx2")
    assert os.environ.get("COMMWEAVE_CPU_ISA", ops._C.CPU_ISA) == ops._C.CPU_ISA


def test_baseline_cpu_kernels_pass_the_cpu_tests_too():
    """The CPU kernels are built for the baseline ISA and for AVX2 + F16C; the tests above run the build
    this CPU picks. This reruns them on the baseline build (COMMWEAVE_CPU_ISA=base)."""
    _expect_kernels("cpu")
    if os.environ.get("COMMWEAVE_CPU_ISA") == "base":
        pytest.skip("already running the baseline build")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "cpu and not baseline"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COMMWEAVE_CPU_ISA": "base"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
