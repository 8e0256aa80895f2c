"""WallFacer's block kernels, forward + backward, on strided inputs against the fp64 reference.

    python -m benchmarks.block_check --device cuda     # sdpa, flash-attn (when it imports), reference
    python -m benchmarks.block_check --device cpu      # the CPU twin: sdpa (ATen's CPU flash), reference

Each case hands the kernel what wallfacer.py hands it (block.py): q, k, v, dO, O as [b, h, s, d] views of
[s, b, h, d] memory, row ranges of larger buffers, and the row range of a larger lse accumulator to the
backward. The results (O, lse, dQ, dK, dV) are compared with the fp64 reference on the same rounded
inputs; a case passes when each error is at most twice that of naive attention computed in the same
dtype on the same device (flash-attn's rule) plus 1e-6. Prints a table; the last line is JSON
``{"benchmark": "block_check", "device", "passed", "cases", "failed": [...]}``; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megatron_patches.block import ReferenceKernel, have_flash_attn, select_kernel

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def default_kernels(device: str) -> dict:
    """name -> (kernel, dtype names) for a device: what ``auto`` can pick there, plus the reference."""
    dev = torch.device(device)
    if dev.type == "cuda":
        out = {"sdpa": (select_kernel("sdpa", dev, torch.float32), ("bf16", "fp16", "fp32"))}
        if have_flash_attn():
            out["flash"] = (select_kernel("flash", dev, torch.bfloat16, head_dim=64), ("bf16", "fp16"))
        out["reference"] = (ReferenceKernel(), ("bf16", "fp32"))
        return out
    return {"sdpa": (select_kernel("sdpa", dev, torch.float32), ("fp32",)),
            "reference": (ReferenceKernel(), ("bf16", "fp32"))}


def naive(q, k, v, scale, causal):
    """Autograd attention in the inputs' dtype (the error baseline): O and the fp32 (fp64 for fp64 inputs)
    logsumexp; [b, h, s, d], K/V heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s if s.dtype == torch.float64 else s.float(), -1)
    return torch.matmul(torch.softmax(s, -1), v), lse


def _strided(rows: int, b: int, heads: int, d: int, dtype, device, gen) -> torch.Tensor:
    """[b, heads, rows, d]: rows [rows/2, 3·rows/2) of a [2·rows, b, heads, d] buffer, permuted."""
    mem = torch.randn(2 * rows, b, heads, d, generator=gen, dtype=torch.float64)
    mem = mem.to(device=device, dtype=dtype)
    return mem[rows // 2:rows // 2 + rows].permute(1, 2, 0, 3)


def case(kernel, dtype, device, causal: bool, hq: int, hkv: int, s: int = 256, b: int = 2, d: int = 64,
         scale: float = 0.125) -> dict:
    gen = torch.Generator().manual_seed(hash((causal, hq, hkv)) % 2**31)
    t = s if causal else s + s // 2
    q, do = (_strided(s, b, hq, d, dtype, device, gen) for _ in range(2))
    k, v = (_strided(t, b, hkv, d, dtype, device, gen) for _ in range(2))
    ref = ReferenceKernel()
    exact = [x.double() for x in (q, k, v, do)]
    o64, lse64 = ref.forward(*exact[:3], scale, causal)
    want = (o64, lse64, *ref.backward(exact[3], *exact[:3], o64, lse64, scale, causal))
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o_naive, _ = naive(*ins, scale, causal)
    o_naive.backward(do)
    base = (o_naive, None, *(x.grad for x in ins))
    o, lse = kernel.forward(q, k, v, scale, causal)
    acc = torch.full((b, hq, 3 * s), float("nan"), dtype=lse.dtype, device=lse.device)
    acc[:, :, s:2 * s] = lse  # the backward gets a row range of a larger accumulator, as in WallFacer
    o_in = o.to(dtype).permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # [b, h, s, d] view again
    grads = kernel.backward(do, q, k, v, o_in, acc[:, :, s:2 * s], scale, causal)
    errors, ok = {}, True
    for name, got, w, bl in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), want, base, strict=True):
        err = (got.double() - w).abs().max().item()
        bound = 2 * ((bl.double() - w).abs().max().item() if bl is not None else 0.0) + 1e-6
        if name == "lse":
            bound = 1e-3 if dtype != torch.float32 else 1e-5  # lse is fp32 in every kernel
        errors[name] = err
        ok &= err <= bound
    return {"errors": errors, "passed": ok}


def run(device: str, kernels: dict | None = None, s: int = 256) -> dict:
    kernels = kernels or default_kernels(device)
    rows, failed = [], []
    print(f"WallFacer block kernels on {device}: forward + backward, strided inputs, vs fp64 reference")
    print(f"  {'kernel':10s} {'dtype':5s} {'mask':7s} {'heads':6s} " + " ".join(f"{n:>9s}" for n in
                                                                              ("o", "lse", "dq", "dk", "dv")))
    for name, (kernel, dtypes) in kernels.items():
        for dt in dtypes:
            for causal in (True, False):
                for hq, hkv in ((8, 8), (8, 2)):
                    res = case(kernel, DTYPES[dt], device, causal, hq, hkv, s=s)
                    label = f"{name} {dt} {'causal' if causal else 'full'} {hq}:{hkv}"
                    rows.append(label)
                    if not res["passed"]:
                        failed.append(label)
                    print(f"  {name:10s} {dt:5s} {'causal' if causal else 'full':7s} {hq}:{hkv:<4d} "
                          + " ".join(f"{e:9.2e}" for e in res["errors"].values())
                          + ("" if res["passed"] else "  FAIL"))
    summary = {"benchmark": "block_check", "device": device, "passed": not failed, "cases": len(rows),
               "failed": failed}
    print(json.dumps(summary))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    return 0 if run(args.device)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
