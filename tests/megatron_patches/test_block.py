"""Per-block attention kernels: forward (o, lse) and backward against autograd, the block-merge identity
the ring relies on, low precision by flash-attn's rule, and the same on a GPU (``cuda`` marker)."""

import pytest
import torch

from benchmarks.block_check import naive
from megatron_patches.block import ReferenceKernel, SdpaKernel, select_kernel
from megatron_patches.steps import _merge

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(b, h, g, s, t, d, dtype, device="cpu"):
    """Inputs as strided [b, h, s, d] views of [s, b, h, d] memory (how WallFacer calls kernels)."""
    torch.manual_seed(7)

    def make(n, heads):
        x = torch.randn(n, b, heads, d, dtype=torch.float64).to(device=device, dtype=dtype)
        return x.permute(1, 2, 0, 3)

    return make(s, h), make(t, g), make(t, g), make(s, h)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), SdpaKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", [4, 2, 1])
def test_kernel_equals_autograd_fp64(kernel, causal, g):
    s = 12
    q, k, v, do = _inputs(2, 4, g, s, s if causal else 20, 8, torch.float64)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = naive(*ins, 0.3, causal)
    o_ref.backward(do)
    o, lse = kernel.forward(q, k, v, 0.3, causal)
    dq, dk, dv = kernel.backward(do, q, k, v, o, lse, 0.3, causal)
    for got, want in zip((o, lse, dq, dk, dv), (o_ref, lse_ref, *(x.grad for x in ins)), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), SdpaKernel()], ids=lambda k: k.name)
def test_blocks_merge_to_full_attention(kernel):
    """Three key blocks: online-softmax merge = full output; block backward with the *final* (o, lse)
    summed over blocks = full gradients (block.py docstring)."""
    q, k, v, do = _inputs(2, 4, 2, 10, 30, 8, torch.float64)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    o_full, _ = naive(*ins, 0.25, False)
    o_full.backward(do)
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    cuts = [slice(0, 7), slice(7, 19), slice(19, 30)]
    for cut in cuts:
        _merge(o, lse, *kernel.forward(q, k[:, :, cut], v[:, :, cut], 0.25, False))
    torch.testing.assert_close(o, o_full.detach(), rtol=0, atol=1e-12)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for cut in cuts:
        bq, bk, bv = kernel.backward(do, q, k[:, :, cut], v[:, :, cut], o, lse, 0.25, False)
        dq += bq
        dk[:, :, cut] += bk
        dv[:, :, cut] += bv
    for got, x in zip((dq, dk, dv), ins, strict=True):
        torch.testing.assert_close(got, x.grad, rtol=0, atol=1e-12)


def _low_precision(device, dtype, kernel_name):
    """flash-attn's rule against the fp32 reference: err(kernel in dtype) <= 2·err(naive torch in dtype)."""
    kernel = select_kernel(kernel_name, torch.device(device), dtype)
    q, k, v, do = _inputs(2, 8, 2, 64, 64, 32, torch.float32, device)
    ref = ReferenceKernel()
    o32, lse32 = ref.forward(q, k, v, 0.2, True)
    want = (o32, *ref.backward(do, q, k, v, o32, lse32, 0.2, True))
    lq, lk, lv, ldo = (x.to(dtype) for x in (q, k, v, do))
    ins = [x.clone().requires_grad_() for x in (lq, lk, lv)]
    o_naive, _ = naive(*ins, 0.2, True)
    o_naive.backward(ldo)
    baseline = (o_naive, *(x.grad for x in ins))
    o, lse = kernel.forward(lq, lk, lv, 0.2, True)
    got = (o, *kernel.backward(ldo, lq, lk, lv, o.to(dtype), lse, 0.2, True))
    for name, g, b, w in zip(("o", "dq", "dk", "dv"), got, baseline, want, strict=True):
        err, base = (g.float() - w).abs().max().item(), (b.float() - w).abs().max().item()
        assert err <= 2 * base + 1e-6, f"{kernel.name} {dtype} {name}: {err:.3g} > 2 x {base:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_low_precision_on_cpu(dtype, kernel):
    """On CPU, auto is sdpa for fp32 and the reference for 16-bit (block.py: ATen's CPU bf16 backward
    misses this rule)."""
    _low_precision("cpu", dtype, kernel)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
def test_kernels_on_gpu(dtype, kernel):
    _low_precision("cuda", dtype, kernel)


def test_select_kernel():
    assert select_kernel("auto", torch.device("cpu"), torch.float32).name == "sdpa"
    assert select_kernel("auto", torch.device("cpu"), torch.bfloat16).name == "reference"
    assert select_kernel("reference", torch.device("cpu"), torch.bfloat16).name == "reference"
    with pytest.raises(ValueError, match="kernel='flash' needs CUDA fp16/bf16"):
        select_kernel("flash", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="kernel='triton' is not one of"):
        select_kernel("triton", torch.device("cpu"), torch.float32)
