"""A packed batch (THD documents) through wallfacer_attention on one device, forward + backward, against
attention inside each document in fp64:

    python -m benchmarks.packed_check --device cuda     # flash-attn's varlen path (when it imports), sdpa
    python -m benchmarks.packed_check --device cpu      # the CPU twin: sdpa (ATen's CPU flash), reference
    python -m benchmarks.packed_check --device cpu --quick   # gpu_check.sh --dry-run: smaller, untimed

One rank (a one-process group): WallFacer's row maps, one call per document, or one varlen call for all
of them where the kernel has one (block.forward_calls; flash-attn: _flash_attn_varlen_forward /
_backward). Documents of 1 … 700 tokens with every remainder mod 2, padded spans too. A case passes when
each error (O, dQ, dK, dV on the valid rows) is at most twice that of naive document attention computed in
the same dtype on the same device, plus 1e-6 (flash-attn's rule). Each case also times the packed call
against one dense causal call over the same tokens (the work a packed batch saves: the documents' scores
only). Prints a table; the last line is JSON ``{"benchmark": "packed_check", "device", "passed", "cases",
"failed": [...]}``; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_patches import packing
from megatron_patches.block import have_flash_attn, select_kernel
from megatron_patches.wallfacer import wallfacer_attention

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
LENGTHS = [700, 1, 37, 256, 5, 129, 64, 2, 333]
QUICK_LENGTHS = [90, 1, 37, 4, 17]  # the same kinds (odd lengths, a 1-token document), smaller: --quick


def default_kernels(device: str) -> dict:
    """name -> (kernel, dtype names) for a device: flash (its varlen path) where flash-attn imports, sdpa,
    and on CPU the reference."""
    dev = torch.device(device)
    if dev.type == "cuda":
        out = {"sdpa": ("sdpa", ("bf16", "fp32"))}
        if have_flash_attn():
            out["flash"] = (select_kernel("flash", dev, torch.bfloat16, head_dim=64), ("bf16", "fp16"))
        return out
    return {"sdpa": ("sdpa", ("fp32",)), "reference": ("reference", ("bf16", "fp32"))}


def _group():
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


def _params(lengths, padded, device):
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:  # the GPU machine without the carried wheels: the same fields will do
        from types import SimpleNamespace as PackedSeqParams
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pad = None if padded is None else torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()],
                                                   dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pad,
                           cu_seqlens_kv_padded=pad, local_cp_size=None, cp_group=None)


def document_attention(q, k, v, doc, scale, causal: bool = True):
    """Autograd attention of every row to the rows of its document (``doc``: each row's, −1 padding; the
    earlier ones if causal), in the inputs' dtype: the error baseline and, in fp64, the oracle. q
    [T, b, h, d], k/v [T, b, g, d] (K/V heads repeated for GQA); padding rows attend nothing, output 0."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    allowed = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if causal:
        allowed &= torch.ones(len(doc), len(doc), dtype=torch.bool, device=doc.device).tril()
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhst,tbhd->sbhd", p.to(v.dtype), v)


def _grads(fn, inputs, do):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _time(fn, inputs, do, device, reps=3) -> float:
    times = []
    for _ in range(reps):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*leaves).backward(do)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def case(kernel, dtype: str, device: str, padded: bool, lengths=LENGTHS, timed: bool = True, b: int = 1,
         hq: int = 8, hkv: int = 2, d: int = 64) -> dict:
    """One packed batch of ``lengths`` (spans padded to even lengths with ``padded``) through ``kernel`` (a
    name or a kernel object): errors and their bounds per output, and the times."""
    group = _group()
    spans = [n + (n % 2) for n in lengths] if padded else None
    ps = _params(lengths, spans, device)
    pack = packing.from_packed_seq_params(ps)
    rows = packing.rows_per_rank(pack, 1)
    doc = torch.full((rows,), -1, device=device)
    for i, (start, valid, _) in enumerate(pack.spans):
        doc[start:start + valid] = i
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(rows, b, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(rows, b, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    low = [t.to(device=device, dtype=DTYPES[dtype]) for t in (q, k, v, do)]
    exact = [t.double().cpu() for t in low]
    scale = d ** -0.5

    def ours(*qkv):
        return wallfacer_attention(*qkv, group, 1, kernel=kernel, packed_seq_params=ps)

    got = _grads(ours, low[:3], low[3])
    want = _grads(lambda *t: document_attention(*t, doc.cpu(), scale), exact[:3], exact[3])
    naive = _grads(lambda *t: document_attention(*t, doc, scale), low[:3], low[3])
    valid = (doc >= 0).cpu()
    errors, bounds = [], []
    for g, w, n in zip(got, want, naive, strict=True):
        errors.append((g.double().cpu() - w)[valid].abs().max().item())
        bounds.append(2 * (n.double().cpu() - w)[valid].abs().max().item() + 1e-6)
    out = {"dtype": dtype, "padded": padded, "errors": errors, "bounds": bounds,
           "passed": all(e <= bd for e, bd in zip(errors, bounds, strict=True)),
           "scores": packing.causal_work(pack), "dense_scores": rows * (rows + 1) // 2}
    if timed:
        out["packed_ms"] = _time(ours, low[:3], low[3], device)
        out["dense_ms"] = _time(_causal_dense, low[:3], low[3], device)
    return out


def _causal_dense(q, k, v):
    """One causal SDPA call over the whole stream (what the same tokens cost as one sequence)."""
    rep = q.shape[2] // k.shape[2]
    bhsd = [t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))]
    return torch.nn.functional.scaled_dot_product_attention(*bhsd, is_causal=True).permute(2, 0, 1, 3)


def run(device: str, kernels: dict | None = None, lengths=LENGTHS, timed: bool = True) -> dict:
    """Every (kernel, dtype, padded) case; prints the table and the JSON line, returns the summary."""
    results = []
    for name, (kernel, dtypes) in (kernels or default_kernels(device)).items():
        for dt in dtypes:
            for padded in (False, True):
                results.append({"kernel": name, **case(kernel, dt, device, padded, lengths, timed)})
    print(f"packed batch: {len(lengths)} documents, {sum(lengths)} tokens, on {device}; errors against "
          f"fp64 (bound: 2 x naive + 1e-6); ms fwd+bwd, packed vs one dense causal call")
    print(f"{'kernel':9} {'dtype':5} {'padded':6} {'O':>9} {'dQ':>9} {'dK':>9} {'dV':>9}  {'packed':>8} "
          f"{'dense':>8}  {'scores/dense':>12}  verdict")
    for r in results:
        errs = " ".join(f"{e:9.2e}" for e in r["errors"])
        ms = f"{r['packed_ms']:8.2f} {r['dense_ms']:8.2f}" if timed else f"{'-':>8} {'-':>8}"
        verdict = "ok" if r["passed"] else "FAIL"
        print(f"{r['kernel']:9} {r['dtype']:5} {r['padded']!s:6} {errs}  {ms}  "
              f"{r['scores'] / r['dense_scores']:12.3f}  {verdict}")
    failed = [f"{r['kernel']} {r['dtype']} padded={r['padded']}" for r in results if not r["passed"]]
    summary = {"benchmark": "packed_check", "device": device, "passed": not failed, "cases": len(results),
               "failed": failed}
    print(json.dumps(summary))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"documents of {QUICK_LENGTHS} tokens, errors only (no timing)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    return 0 if run(args.device, lengths=lengths, timed=not args.quick)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
