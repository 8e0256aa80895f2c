"""ds_plugins.dispatch at its edges: bad input raises ValueError naming the argument and the rule,
the ops stay memory-safe when called directly, meta tensors and torch.compile trace through the fake
kernels, and a missing extension falls back to the reference with exactly one warning."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_plugins import dispatch as ops
from ds_plugins import reference

S, M, E, C = 6, 4, 3, 4


def _routes():
    indices = torch.tensor([[0, 1, 2, -1, 0, 1], [1, 2, 0, 0, -1, -1]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, 0, 9, 1, 1], [2, 1, 3, 2, -5, 7]], dtype=torch.int32)
    return indices, locations, torch.rand(2, S)


def _with(tensor, index, value):
    out = tensor.clone()
    out[index] = value
    return out


def _dispatch_cases():
    x = torch.randn(S, M)
    idx, loc, _ = _routes()
    return {
        "x not a tensor": ((x.tolist(), idx, loc, E, C), r"x must be a torch.Tensor \[S, M\]"),
        "x 3-D": ((x[None], idx, loc, E, C), r"x must be 2-D \[S, M\], got shape \(1, 6, 4\)"),
        "x int": ((x.int(), idx, loc, E, C), r"x \[S, M\] must have dtype float16, .* got torch.int32"),
        "indices int64": ((x, idx.long(), loc, E, C),
                          r"indices \[k, S\] must have dtype int32, got torch.int64"),
        "indices 1-D": ((x, idx[0], loc, E, C), r"indices must be 2-D \[k, S\], got shape \(6,\)"),
        "locations shape": ((x, idx, loc[:1], E, C), r"locations \(1, 6\) must have the shape of indices"),
        "S mismatch": ((x[:5], idx, loc, E, C), r"indices \[k, S\] has S = 6 tokens but x \[S, M\] has 5"),
        "k = 0": ((x, idx[:0], loc[:0], E, C), r"k >= 1 routes per token, got k = 0"),
        "num_experts": ((x, idx, loc, 0, C), r"num_experts=0: must be an integer in \[1, 2147483647\] "
                                             r"\(expert indices are int32\)"),
        "capacity float": ((x, idx, loc, E, 4.0), r"capacity=4.0: must be an integer in \[0, 2147483647\] "
                                                  r"\(locations are int32\)"),
        "capacity bool": ((x, idx, loc, E, True), r"capacity=True: must be an integer in \[0, "),
        "index too big": ((x, _with(idx, (1, 2), 3), loc, E, C),
                          r"indices\[1, 2\] = 3: expert indices must be -1 \(dropped route\) or in "
                          r"\[0, num_experts = 3\)"),
        "index below -1": ((x, _with(idx, (0, 0), -2), loc, E, C), r"indices\[0, 0\] = -2"),
        "location >= capacity": ((x, idx, _with(loc, (0, 4), 4), E, C),
                                 r"locations\[0, 4\] = 4 on a live route \(expert 0\): locations must "
                                 r"be in \[0, capacity = 4\)"),
        "location < 0": ((x, idx, _with(loc, (1, 0), -1), E, C), r"locations\[1, 0\] = -1 on a live route"),
        "slot collision": ((x, idx, _with(loc, (1, 3), 0), E, C),
                           r"routes \(j=0, s=0\) and \(j=1, s=3\) both claim expert 0, location 0: "
                           r"a slot holds one token"),
        "devices": ((x.to("meta"), idx, loc, E, C), r"indices is on cpu but x \[S, M\] is on meta"),
    }


@pytest.mark.parametrize("case", list(_dispatch_cases()))
def test_dispatch_rejects(case):
    args, match = _dispatch_cases()[case]
    with pytest.raises(ValueError, match=match):
        ops.dispatch(*args)


def _combine_cases():
    eo = torch.randn(E, C, M)
    idx, loc, gates = _routes()
    return {
        "expert_output 2-D": ((eo[0], idx, loc, gates), r"expert_output must be 3-D \[E, C, M\]"),
        "gates bf16": ((eo, idx, loc, gates.bfloat16()), r"gates \[k, S\] must have dtype float32, "
                                                         r"float64, got torch.bfloat16"),
        "gates k": ((eo, idx, loc, gates[:1]), r"gates \(1, 6\) must have the shape of indices \(2, 6\)"),
        "gates S": ((eo, idx, loc, gates[:, :5]),
                    r"indices \[k, S\] has S = 6 tokens but gates \[k, S\] has 5"),
        "no experts": ((eo[:0], idx, loc, gates), r"expert_output \[E, C, M\]'s E=0: must be an integer "
                                                  r"in \[1, "),
        "index too big": ((eo[:2], idx, loc, gates), r"indices\[0, 2\] = 2: .* \[0, num_experts = 2\)"),
        "location >= capacity": ((eo[:, :2], idx, loc, gates), r"locations\[1, 0\] = 2 on a live route"),
        "gates device": ((eo, idx, loc, gates.to("meta")), r"gates is on meta but expert_output is on cpu"),
    }


@pytest.mark.parametrize("case", list(_combine_cases()))
def test_combine_rejects(case):
    args, match = _combine_cases()[case]
    with pytest.raises(ValueError, match=match):
        ops.combine(*args)


def test_capacity_may_be_a_tensor_as_deepspeeds_gates_return_it():
    idx, loc, _ = _routes()
    x = torch.randn(S, M)
    assert torch.equal(ops.dispatch(x, idx, loc, torch.tensor(E), torch.tensor(C)),
                       reference.dispatch(x, idx, loc, E, C))


def test_direct_op_calls_are_checked_in_cpp():
    """torch.ops.commweave.* bypass the Python checks; the C++ ones keep them memory-safe."""
    assert ops.backend("cpu") == "cpu", "build ds_plugins._C first"
    x, eo = torch.randn(S, M), torch.randn(E, C, M)
    idx, loc, gates = _routes()
    bad = _with(idx, (0, 1), 7)
    with pytest.raises(RuntimeError, match="route to expert 7 location 0 is outside"):
        torch.ops.commweave.dispatch(x, bad, loc, E, C)
    with pytest.raises(RuntimeError, match="is outside"):
        torch.ops.commweave.combine(eo, bad, loc, gates)
    with pytest.raises(RuntimeError, match="is outside"):
        torch.ops.commweave.dispatch_backward(eo, bad, loc, S)
    with pytest.raises(RuntimeError, match="is outside"):
        torch.ops.commweave.combine_backward(x, eo, bad, loc, gates, True, True)
    with pytest.raises(RuntimeError, match="both claim expert 0 location 0"):
        torch.ops.commweave.dispatch(x, idx, _with(loc, (1, 3), 0), E, C)
    with pytest.raises(RuntimeError, match="indices must be int32"):
        torch.ops.commweave.dispatch(x, idx.long(), loc, E, C)


def test_meta_tensors_and_torch_compile_trace_through_the_fake_kernels():
    idx, loc, gates = _routes()
    meta = [t.to("meta") for t in (idx, loc, gates)]
    assert torch.ops.commweave.dispatch(torch.empty(S, M, device="meta"), meta[0], meta[1], E, C).shape \
        == (E, C, M)
    assert torch.ops.commweave.combine(torch.empty(E, C, M, device="meta"), *meta).shape == (S, M)
    grads = torch.ops.commweave.combine_backward(torch.empty(S, M, device="meta"),
                                                 torch.empty(E, C, M, device="meta"), *meta, True, False)
    assert grads[0].shape == (E, C, M) and grads[1].shape == (0,)

    def layer(x, eo, gates):
        return ops.combine(ops.dispatch(x, idx, loc, E, C) * eo, idx, loc, gates)

    x, eo = torch.randn(S, M, requires_grad=True), torch.randn(E, C, M, requires_grad=True)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    eager_out, compiled_out = layer(x, eo, gates), compiled(x, eo, gates)
    assert torch.equal(eager_out, compiled_out)
    grad_eager, grad_compiled = (torch.autograd.grad(y.sum(), x)[0] for y in (eager_out, compiled_out))
    assert torch.equal(grad_eager, grad_compiled)


def test_missing_extension_falls_back_to_the_reference_with_one_warning():
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["ds_plugins._C"] = None  # what Python does for a module that failed to import
        import torch
        from ds_plugins import dispatch as ops, reference
        idx = torch.tensor([[0, 1, -1], [1, 0, 0]], dtype=torch.int32)
        loc = torch.tensor([[0, 0, 5], [1, 1, 2]], dtype=torch.int32)
        x, gates = torch.randn(3, 4, requires_grad=True), torch.rand(2, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                y = ops.combine(ops.dispatch(x, idx, loc, 2, 3), idx, loc, gates)
            y.sum().backward()
        assert ops.backend("cpu") == "torch", ops.backend("cpu")
        assert torch.equal(y, reference.combine(reference.dispatch(x, idx, loc, 2, 3), idx, loc, gates))
        print(len(caught), caught[0].category.__name__, caught[0].message)
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    count, category, message = done.stdout.strip().split(" ", 2)
    assert (count, category) == ("1", "RuntimeWarning")
    assert "pure-torch reference" in message and "ds_plugins._C is not built" in message


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", ["index too big", "index below -1", "location >= capacity", "location < 0",
                                  "slot collision"])
def test_fault_finders_agree(case, device):
    """The kernels' finders (C++, CUDA) and the torch one (the fallback) report the same fault."""
    assert ops.backend(device) == device, f"build ds_plugins._C with {device} kernels first"
    _, idx, loc, num_experts, capacity = _dispatch_cases()[case][0]
    idx, loc = idx.to(device), loc.to(device)
    fault = torch.ops.commweave.find_route_fault(idx, loc, num_experts, capacity)
    assert fault and fault == ops._find_route_fault_torch(idx, loc, num_experts, capacity)
    idx, loc, _ = (t.to(device) for t in _routes())
    assert torch.ops.commweave.find_route_fault(idx, loc, E, C) == []
    assert ops._find_route_fault_torch(idx, loc, E, C) == []


def test_checked_routes_are_rechecked_after_an_in_place_change():
    """combine may reuse dispatch's check of the same route tensors, never of modified ones."""
    x, eo = torch.randn(S, M), torch.randn(E, C, M)
    idx, loc, gates = _routes()
    ops.dispatch(x, idx, loc, E, C)
    ops.combine(eo, idx, loc, gates)
    loc[1, 3] = 0  # now collides with route (0, 0)
    with pytest.raises(ValueError, match="both claim expert 0, location 0"):
        ops.combine(eo, idx, loc, gates)
    loc[1, 3] = 2
    idx[0, 1] = 9
    with pytest.raises(ValueError, match=r"indices\[0, 1\] = 9"):
        ops.dispatch(x, idx, loc, E, C)


def test_inference_mode_routes_are_checked_every_time():
    """Tensors made under torch.inference_mode have no version counter: the ops run, and check anew."""
    x = torch.randn(S, M)
    idx, loc, gates = _routes()
    want = ops.combine(ops.dispatch(x, idx, loc, E, C), idx, loc, gates)
    with torch.inference_mode():
        idx_i, loc_i, x_i = idx.clone(), loc.clone(), x.clone()
        got = ops.combine(ops.dispatch(x_i, idx_i, loc_i, E, C), idx_i, loc_i, gates)
        loc_i[1, 3] = 0  # the same tensors, changed in place: a slot collision
        with pytest.raises(ValueError, match="both claim expert 0, location 0"):
            ops.dispatch(x_i, idx_i, loc_i, E, C)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
