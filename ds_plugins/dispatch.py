"""Fused MoE dispatch and combine, in DeepSpeed's sparse-route format, with autograd.

``dispatch`` places tokens in per-expert buffers and ``combine`` brings the expert outputs back,
weighted by the gates. They return what ``deepspeed.moe.sharded_moe._sparse_encode`` and
``_sparse_decode`` return for the same routes (``TopKGate(..., sparse_routes)`` output plugs straight
in), but in one pass over the data each way instead of several tensor ops. The maths, the route
format and the shape legend (S, M, E, C, k) are in :mod:`ds_plugins.reference`.

Three paths, reported by :func:`backend`: ``"cuda"`` and ``"cpu"`` run the kernels of the extension
``ds_plugins._C`` (csrc/); ``"torch"`` runs :mod:`ds_plugins.reference`, with one warning saying why
(the extension is not built, or was built without CUDA kernels and the tensors are on a GPU).

Every argument is checked before any kernel runs; bad input raises ValueError naming the argument, the
value and the rule (commweave.values). Sizes are bounded by what the kernels index with: E and C by int32
(expert indices and locations are int32), k·S by int32 (routes are numbered j·S + s), and every buffer a
kernel allocates or copies by values.MAX_ALLOC_BYTES (2**47), all computed exactly before anything is
allocated (E·C = 2**32 · 2**32 wraps to 0 in int64). The C++ ops check the same with TORCH_CHECK for
direct callers (csrc/routes.h). Two live routes claiming the same (expert, slot) are rejected too:
DeepSpeed's gates never produce that, and a buffer slot can hold one token. The value checks (index
ranges, slot collisions) are one pass over the k·S routes (C++ on the CPU; two small kernels and one copy
to the host, i.e. one synchronisation, on a GPU) and run on every call, combine's included: a verdict
cached from dispatch cannot be tied to the route tensors' contents, because their version counters miss
writes through ``.data``, ``.numpy()`` or DLPack (issue 22: two routes on one slot were accepted that
way). The checks are skipped while torch.compile traces and for meta tensors.
"""

from __future__ import annotations

import os
import warnings

import torch

from commweave import values
from ds_plugins import reference

try:
    from ds_plugins import _C  # registers torch.ops.commweave.*
except ImportError as error:  # not built: fall back to the reference (one warning, at first use)
    _C = None
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned: set[str] = set()


def backend(device: torch.device | str | None = None) -> str:
    """Which path dispatch/combine take for tensors on ``device``: "cuda", "cpu" or "torch".

    ``device=None`` means the default accelerator: CUDA when one is visible, else the CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if _C is None:
        return "torch"
    if kind == "cpu":
        return "cpu"
    if kind == "cuda" and _C.WITH_CUDA:
        return "cuda"
    return "torch"


def _warn_fallback(device: torch.device) -> None:
    if _C is None:
        reason = (f"the extension ds_plugins._C is not built ({_IMPORT_ERROR}); build it with "
                  "`pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace`")
    else:
        reason = (f"ds_plugins._C was built without CUDA kernels and the tensors are on {device}; "
                  "rebuild on a machine with CUDA torch and a CUDA toolkit (COMMWEAVE_CUDA=1)")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"commweave dispatch/combine run the pure-torch reference (slow): {reason}",
                      RuntimeWarning, stacklevel=3)


def _check_tensor(name: str, t, shape: str, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {shape}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} {shape} must have dtype {allowed}, got {t.dtype}")


def _check_count(name: str, value, minimum: int, why: str) -> int:
    return values.integer(value, name, lo=minimum, hi=values.INT32_MAX, unit=why)


_HOST_RAM = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _memory(device: torch.device) -> tuple[int, str]:
    """The most bytes one buffer on ``device`` can take, and its name: the device's memory (a GPU's, or
    the host's RAM), at most values.MAX_ALLOC_BYTES (the bound alone while torch.compile traces: the
    device query is not traceable; the C++ ops check 2**47 again)."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        total, what = torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    elif device.type == "cpu":
        total, what = _HOST_RAM, "this host's RAM"
    else:
        total, what = values.MAX_ALLOC_BYTES, "2**47, what a process can address"
    return (total, what) if total <= values.MAX_ALLOC_BYTES else (values.MAX_ALLOC_BYTES, "2**47")


def _check_bytes(name: str, shape, t: torch.Tensor) -> None:
    """The buffer ``name`` [shape] of ``t``'s dtype (an output, or a contiguous copy a kernel makes of a
    strided input) must fit in its device's memory: refused here rather than by the allocator."""
    limit, what = _memory(t.device)
    values.product(name, [*shape, t.element_size()], limit=limit, unit="bytes", limit_name=what)


def _check_slots(num_experts: int, capacity: int, device: torch.device) -> None:
    """The slot table [E·C] int32 of the route check and of dispatch."""
    limit, what = _memory(device)
    values.product("the slot table [E·C] int32", [num_experts, capacity, 4], limit=limit, unit="bytes",
                   limit_name=what)


def _check_route_shapes(indices, locations, num_tokens: int, source: str, device: torch.device) -> None:
    _check_tensor("indices", indices, "[k, S]", 2, (torch.int32,))
    _check_tensor("locations", locations, "[k, S]", 2, (torch.int32,))
    if locations.shape != indices.shape:
        raise ValueError(f"locations {tuple(locations.shape)} must have the shape of indices "
                         f"{tuple(indices.shape)}, [k, S]")
    k, routed_tokens = indices.shape
    if k < 1:
        raise ValueError("indices [k, S] must have k >= 1 routes per token, got k = 0")
    if routed_tokens != num_tokens:
        raise ValueError(f"indices [k, S] has S = {routed_tokens} tokens but {source} has {num_tokens}: "
                         "S must match")
    values.product("indices [k, S]", [k, routed_tokens], limit=values.INT32_MAX,
                   unit="routes (numbered j·S + s in int32)")
    for name, t in (("indices", indices), ("locations", locations)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {source} is on {device}: use one device")


_BAD_INDEX, _BAD_LOCATION, _COLLISION = 1, 2, 3  # csrc/routes.h, RouteFault


def _find_route_fault_torch(indices: torch.Tensor, locations: torch.Tensor, num_experts: int,
                            capacity: int) -> list[int]:
    """torch.ops.commweave.find_route_fault for any device, with one host sync when all is well."""
    live = indices >= 0
    bad_index = (indices < -1) | (indices >= num_experts)
    bad_location = live & ((locations < 0) | (locations >= capacity))
    slots = torch.where(live & ~bad_location, indices.long() * capacity + locations, -1)
    claims = torch.bincount(slots.clamp(-1, num_experts * capacity).reshape(-1) + 1,
                            minlength=num_experts * capacity + 2)[1:-1]
    flags = torch.stack([bad_index.any(), bad_location.any(), (claims > 1).any()]).tolist()
    if flags[0]:
        return [_BAD_INDEX, int(bad_index.reshape(-1).nonzero()[0])]
    if flags[1]:
        return [_BAD_LOCATION, int(bad_location.reshape(-1).nonzero()[0])]
    if flags[2]:  # the first route, in (j, s) order, whose slot an earlier route holds
        owner: dict[int, int] = {}
        for r, slot in enumerate(slots.reshape(-1).tolist()):
            if slot >= 0 and owner.setdefault(slot, r) != r:
                return [_COLLISION, r, owner[slot]]
    return []


def _check_route_values(indices: torch.Tensor, locations: torch.Tensor, num_experts: int,
                        capacity: int) -> None:
    """Index ranges and slot collisions of live routes, on every call (skipped while tracing: they read
    values)."""
    if indices.device.type == "meta" or torch.compiler.is_compiling():
        return
    if backend(indices.device) != "torch":
        fault = torch.ops.commweave.find_route_fault(indices, locations, num_experts, capacity)
    else:
        fault = _find_route_fault_torch(indices, locations, num_experts, capacity)
    if not fault:
        return
    num_tokens = indices.shape[1]
    j, s = divmod(fault[1], num_tokens)
    if fault[0] == _BAD_INDEX:
        raise ValueError(f"indices[{j}, {s}] = {int(indices[j, s])}: expert indices must be -1 "
                         f"(dropped route) or in [0, num_experts = {num_experts})")
    if fault[0] == _BAD_LOCATION:
        raise ValueError(f"locations[{j}, {s}] = {int(locations[j, s])} on a live route (expert "
                         f"{int(indices[j, s])}): locations must be in [0, capacity = {capacity})")
    j0, s0 = divmod(fault[2], num_tokens)
    raise ValueError(f"routes (j={j0}, s={s0}) and (j={j}, s={s}) both claim expert {int(indices[j, s])}, "
                     f"location {int(locations[j, s])}: a slot holds one token")


def dispatch(x: torch.Tensor, indices: torch.Tensor, locations: torch.Tensor, num_experts: int,
             capacity: int) -> torch.Tensor:
    """Place each routed token of x[S, M] in its expert slot: returns [E, C, M], empty slots zero.

    Same result as ``_sparse_encode(x, _route_slots(indices, locations, E, C), E, C)``; differentiable
    in x (its gradient sums the k routes of each token).
    """
    _check_tensor("x", x, "[S, M]", 2, _FLOATS)
    num_experts = _check_count("num_experts", num_experts, 1, "expert indices are int32")
    capacity = _check_count("capacity", capacity, 0, "locations are int32")
    _check_route_shapes(indices, locations, x.shape[0], "x [S, M]", x.device)
    _check_bytes("x [S, M]", x.shape, x)
    _check_bytes("the output [E, C, M]", (num_experts, capacity, x.shape[1]), x)
    _check_slots(num_experts, capacity, x.device)
    _check_route_values(indices, locations, num_experts, capacity)
    path = backend(x.device)
    if path == "torch":
        _warn_fallback(x.device)
        return reference.dispatch(x, indices, locations, num_experts, capacity)
    return torch.ops.commweave.dispatch(x, indices, locations, num_experts, capacity)


def combine(expert_output: torch.Tensor, indices: torch.Tensor, locations: torch.Tensor,
            gates: torch.Tensor) -> torch.Tensor:
    """Bring the expert outputs [E, C, M] back to tokens: y[S, M] = Σ_j gates[j, s] · route (j, s).

    Same result as ``_sparse_decode``: accumulated in fp32 (fp64 when an operand is fp64) and
    returned in the dtype of expert_output. Differentiable in expert_output and gates.
    """
    _check_tensor("expert_output", expert_output, "[E, C, M]", 3, _FLOATS)
    _check_tensor("gates", gates, "[k, S]", 2, (torch.float32, torch.float64))
    _check_route_shapes(indices, locations, gates.shape[1], "gates [k, S]", expert_output.device)
    if gates.shape != indices.shape:
        raise ValueError(f"gates {tuple(gates.shape)} must have the shape of indices "
                         f"{tuple(indices.shape)}, [k, S]")
    if gates.device != expert_output.device:
        raise ValueError(f"gates is on {gates.device} but expert_output is on {expert_output.device}: "
                         "use one device")
    num_experts, capacity, _ = expert_output.shape
    _check_count("expert_output [E, C, M]'s E", num_experts, 1, "expert indices are int32")
    _check_count("expert_output [E, C, M]'s C", capacity, 0, "locations are int32")
    _check_bytes("expert_output [E, C, M]", expert_output.shape, expert_output)
    _check_bytes("the output [S, M]", (gates.shape[1], expert_output.shape[2]), expert_output)
    _check_slots(num_experts, capacity, expert_output.device)
    _check_route_values(indices, locations, num_experts, capacity)
    path = backend(expert_output.device)
    if path == "torch":
        _warn_fallback(expert_output.device)
        return reference.combine(expert_output, indices, locations, gates)
    return torch.ops.commweave.combine(expert_output, indices, locations, gates)


def _dispatch_setup(ctx, inputs, output) -> None:
    x, indices, locations, _, _ = inputs
    ctx.save_for_backward(indices, locations)
    ctx.num_tokens = x.shape[0]


def _dispatch_backward(ctx, grad):
    indices, locations = ctx.saved_tensors
    return torch.ops.commweave.dispatch_backward(grad, indices, locations, ctx.num_tokens), None, None, \
        None, None


def _combine_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, grad):
    expert_output, indices, locations, gates = ctx.saved_tensors
    need_expert, need_gates = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    grad_expert, grad_gates = torch.ops.commweave.combine_backward(
        grad, expert_output, indices, locations, gates, need_expert, need_gates)
    return (grad_expert if need_expert else None), None, None, (grad_gates if need_gates else None)


if _C is not None:
    torch.library.register_autograd("commweave::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
    torch.library.register_autograd("commweave::combine", _combine_backward, setup_context=_combine_setup)


def _dispatch_fake(x, indices, locations, num_experts, capacity):
    return x.new_empty(num_experts, capacity, x.shape[1])


def _dispatch_backward_fake(grad, indices, locations, num_tokens):
    return grad.new_empty(num_tokens, grad.shape[2])


def _combine_fake(expert_output, indices, locations, gates):
    return expert_output.new_empty(indices.shape[1], expert_output.shape[2])


def _combine_backward_fake(grad, expert_output, indices, locations, gates, need_expert_grad, need_gates_grad):
    return (expert_output.new_empty(expert_output.shape if need_expert_grad else (0,)),
            gates.new_empty(gates.shape if need_gates_grad else (0,)))


if _C is not None:
    # Shape-only kernels: meta tensors, FakeTensor tracing and torch.compile use these.
    torch.library.register_fake("commweave::dispatch", _dispatch_fake)
    torch.library.register_fake("commweave::dispatch_backward", _dispatch_backward_fake)
    torch.library.register_fake("commweave::combine", _combine_fake)
    torch.library.register_fake("commweave::combine_backward", _combine_backward_fake)
