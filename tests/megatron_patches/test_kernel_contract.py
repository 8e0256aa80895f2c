"""Every call WallFacer makes into a GPU block kernel's library keeps that library's layout contract.

The GPU paths' kernels (block.FlashKernel over flash-attn, block.SdpaKernel's CUDA path over ATen's
memory-efficient attention) run here on CPU tensors against strict stand-ins of those libraries
(strict_kernels.py): any non-contiguous lse, wrong stride, dtype or shape raises. A whole forward and
backward of wallfacer_attention at P = 4 and 8, causal and not, C = 1 and 2, both backward variants,
GQA, must make every call pass and match full attention; ``deterministic`` must reach every backward.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_patches.block import FlashKernel, SdpaKernel
from megatron_patches.wallfacer import wallfacer_attention
from tests.megatron_patches.strict_kernels import (
    ContractError,
    StrictEfficientOps,
    StrictFlashAttn,
    StrictFlashVarlen,
)
from tests.megatron_patches.test_wallfacer import _global_inputs, _reference, local_rows

B, HQ, HKV = 2, 4, 2


def _kernel(name, deterministic=False, raises=True):
    if name == "flash":
        lib = StrictFlashAttn(raises)
        return FlashKernel(deterministic, interface=lib), lib, torch.bfloat16
    lib = StrictEfficientOps(raises)
    return SdpaKernel(deterministic, ops=lib, cuda=True), lib, torch.float32


def _case(name, c, causal, mode, deterministic=False, s_local=8, d=16):
    """Max errors (out, dq, dk, dv) against fp64 full attention on the same rounded inputs, next to
    naive attention in the kernel's dtype; and the calls the library saw."""
    world, rank = dist.get_world_size(), dist.get_rank()
    kernel, lib, dtype = _kernel(name, deterministic, raises=False)
    q, k, v, do = (t.to(dtype).double() for t in _global_inputs(world * s_local, B, HQ, HKV, d))
    rows = local_rows("zigzag", world, rank, s_local)
    mine = [t[rows].to(dtype).requires_grad_() for t in (q, k, v)]
    out = wallfacer_attention(*mine, dist.group.WORLD, c, causal=causal, kernel=kernel, backward=mode,
                              deterministic=deterministic)
    out.backward(do[rows].to(dtype))
    exact, low = _reference(q, k, v, do, causal), _reference(q, k, v, do, causal, dtype)
    got = [out, *(t.grad for t in mine)]
    return {"err": [(g.double() - w[rows]).abs().max().item() for g, w in zip(got, exact, strict=True)],
            "naive": [(lo.double() - w)[rows].abs().max().item() for lo, w in zip(low, exact, strict=True)],
            "calls": lib.calls, "violations": lib.violations,
            "deterministic_after": torch.are_deterministic_algorithms_enabled()}


def _cases():
    return [(name, c, causal, mode) for name in ("flash", "sdpa-cuda") for c in (1, 2)
            for causal in (True, False) for mode in ("kv", "q")]


def _run_all(cases):
    return {case: _case(*case) for case in cases}


def _check(world):
    results = world.run(_run_all, _cases())
    for case in _cases():
        for r, res in enumerate(results):
            assert not res[case]["violations"], f"{case} rank {r}: {res[case]['violations'][:3]}"
            fns = [call["fn"] for call in res[case]["calls"]]
            assert "forward" in fns and "backward" in fns, (case, fns)
            errors = zip(("out", "dq", "dk", "dv"), res[case]["err"], res[case]["naive"], strict=True)
            for name, e, n in errors:
                # fp32 (efficient): as tight as the fp32 cases of test_wallfacer; bf16 (flash): the
                # flash-attn rule, at most twice naive bf16 attention's error.
                bound = 2e-5 if case[0] == "sdpa-cuda" else 2 * n
                assert e <= bound, f"{case} rank {r} {name}: {e:.3g} > {bound:.3g}"


@pytest.mark.slow
@pytest.mark.world_size(4)
def test_every_kernel_call_keeps_the_contract_p4(world):
    _check(world)


@pytest.mark.slow
@pytest.mark.world_size(8)
def test_every_kernel_call_keeps_the_contract_p8(world):
    _check(world)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("name", ["flash", "sdpa-cuda"])
def test_deterministic_reaches_every_backward(world, name):
    for res in world.run(_case, name, 2, True, "kv", True):
        backward = [call for call in res["calls"] if call["fn"] == "backward"]
        assert backward and all(call["deterministic"] for call in backward), res["calls"]
        assert not res["deterministic_after"], "torch's deterministic switch must be restored"
    for res in world.run(_case, name, 2, True, "kv", False):
        assert not any(call.get("deterministic") for call in res["calls"]), res["calls"]


def _packed_case(c, u, mode, padded_lse, d=16):
    """A packed batch through flash-attn's varlen functions (strict stand-ins): the errors against fp64
    document attention on the same rounded inputs, next to naive bf16 document attention's; the calls."""
    from megatron_patches import packing
    from tests.megatron_patches.test_packed import BATCHES, doc_of, document_attention, params

    lib = StrictFlashVarlen(raises=False, padded_lse=padded_lse)
    kernel, world = FlashKernel(interface=lib), dist.get_world_size()
    ps = params(*BATCHES["mixed"])
    pack = packing.from_packed_seq_params(ps)
    total = packing.rows_per_rank(pack, world) * world
    q, k, v, do = (t.to(torch.bfloat16).double() for t in _global_inputs(total, 1, HQ, HKV, d))
    doc, rows = doc_of(pack, total), torch.tensor(packing.rank_index(packing.shards(pack, "zigzag", world)[
        dist.get_rank()]))
    mine = [t[rows].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    out = wallfacer_attention(*mine, dist.group.WORLD, c, kernel=kernel, backward=mode, ulysses_size=u,
                              packed_seq_params=ps)
    out.backward(do[rows].to(torch.bfloat16))

    def oracle(dtype):
        inputs = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        o = document_attention(*inputs, doc, d ** -0.5, True)
        o.backward(do.to(dtype))
        return [o] + [t.grad for t in inputs]

    exact, low = oracle(torch.float64), oracle(torch.bfloat16)
    got = [out, *(t.grad for t in mine)]
    return {"err": [(g.double() - w[rows]).abs().max().item() for g, w in zip(got, exact, strict=True)],
            "naive": [(lo.double() - w)[rows].abs().max().item() for lo, w in zip(low, exact, strict=True)],
            "fns": [call["fn"] for call in lib.calls], "violations": lib.violations}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("c, u, mode, padded_lse", [(1, 1, "kv", False), (2, 1, "q", False),
                                                    (2, 1, "kv", True), (1, 2, "q", False)])
def test_packed_batches_go_through_flash_varlen_within_its_contract(world, c, u, mode, padded_lse):
    for r, res in enumerate(world.run(_packed_case, c, u, mode, padded_lse)):
        assert not res["violations"], res["violations"][:3]
        assert "varlen_forward" in res["fns"] and "varlen_backward" in res["fns"], res["fns"]
        for name, e, n in zip(("out", "dq", "dk", "dv"), res["err"], res["naive"], strict=True):
            assert e <= 2 * n + 1e-6, f"rank {r} {name}: {e:.3g} > 2 x naive bf16 {n:.3g}"


def test_the_stand_ins_refuse_a_strided_lse():
    """The bug the contract test exists for: a row range of a larger lse handed to mha_bwd."""
    lib = StrictFlashAttn()
    q = torch.randn(1, 8, 2, 8, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16)[:, :, 4:12]
    with pytest.raises(ContractError, match="softmax_lse is read by raw pointer"):
        grads = (torch.empty_like(q) for _ in range(3))
        lib._flash_attn_backward(q, q, q, q, q, lse, *grads, 0.0, 0.3, False, -1, -1, 0.0, None, False)
    with pytest.raises(ContractError, match="last dim must have stride 1"):
        lib._flash_attn_forward(q.transpose(-1, -2), q, q, 0.0, 0.3, False, -1, -1, 0.0, None, False)


def test_kernels_hand_the_library_a_contiguous_lse():
    """Block-level: each kernel's backward on a strided lse passes the strict library and equals the
    reference kernel."""
    from megatron_patches.block import ReferenceKernel

    torch.manual_seed(0)
    mem = torch.randn(16, 2, 4, 8).permute(1, 2, 0, 3)  # [b, h, s, d] view of [s, b, h, d]
    q, k, v, do = mem[:, :, 4:12], mem[:, :2, 0:8], mem[:, 2:, 8:16], mem[:, :, 0:8]
    for name in ("flash", "sdpa-cuda"):
        kernel, _, dtype = _kernel(name)
        lq, lk, lv, ldo = (t.to(dtype) for t in (q, k, v, do))
        o, lse = kernel.forward(lq, lk, lv, 0.3, True)
        big = torch.zeros(2, 4, 24)
        big[:, :, 8:16] = lse
        got = kernel.backward(ldo, lq, lk, lv, o, big[:, :, 8:16], 0.3, True)
        want = ReferenceKernel().backward(*(t.double() for t in (ldo, lq, lk, lv, o)), lse.double(), 0.3,
                                          True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
