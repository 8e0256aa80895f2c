"""One attention block with its log-sum-exp: the compute kernel under WallFacer's ring loop.

Shape legend (all tensors may be strided views): b batch, h query heads, g K/V heads (h % g == 0,
query head j reads K/V head j // (h/g), Megatron's GQA convention), s query rows, t key rows,
d head dim.

    forward(q_bhsd, k_bgtd, v_bgtd, scale, causal)          -> o_bhsd, lse_bhs
    backward(do_bhsd, q, k, v, o_bhsd, lse_bhs, scale, causal) -> dq_bhsd, dk_bgtd, dv_bgtd

lse_bhs = log Σ_t exp(scale·q·k_t) per row. ``causal`` masks key t > query s (both blocks start at
the same position; WallFacer only asks for it on square blocks). ``backward`` takes the *final*
output and lse of the whole row (not the block's): then P = exp(scale·q·kᵀ − lse) is the block's
slice of the global softmax, and with D = rowsum(dO∘O) (FlashAttention-2, Alg. 2)

    dV = Pᵀ·dO,   dS = P∘(dO·Vᵀ − D),   dQ = scale·dS·K,   dK = scale·dSᵀ·Q

are exactly this block's contributions to the gradients of the full attention.

Kernels: ``reference`` (explicit matrices in fp32, fp64 for fp64 inputs — the oracle and the
fallback), ``sdpa`` (ATen's fused attention: the flash kernel for CPU, the memory-efficient kernel
on CUDA) and ``flash`` (the flash-attn package, CUDA, fp16/bf16). ``select_kernel("auto", ...)``
picks flash-attn when it imports and fits, else sdpa — except 16-bit inputs on CPU, where ATen's
flash backward is both slower than the fp32 reference (2.6-2.9x, 256-1024 rows, 8 heads) and less
accurate (dV error 2.1x that of naive bf16 attention), so auto takes the reference there.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from typing import ClassVar

import torch
import torch.nn.functional as F

KERNELS = ("auto", "sdpa", "flash", "reference")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Online-softmax state and gradient accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(dkv: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of the ``groups`` query heads that shared one K/V head."""
    if groups == 1:
        return dkv
    b, h, t, d = dkv.shape
    return dkv.view(b, h // groups, groups, t, d).sum(2)


class ReferenceKernel:
    """Explicit softmax attention in the accumulation dtype; returns fp32/fp64 results."""

    name = "reference"

    @staticmethod
    def _probs(q, k, lse, scale, causal):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                              float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        return torch.exp(s - lse.unsqueeze(-1)), lse

    def forward(self, q, k, v, scale, causal):
        acc = acc_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        q, k, v = q.to(acc), _expand(k.to(acc), groups), _expand(v.to(acc), groups)
        p, lse = self._probs(q, k, None, scale, causal)
        return torch.matmul(p, v), lse

    def backward(self, do, q, k, v, o, lse, scale, causal):
        acc = acc_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        do, q, o = do.to(acc), q.to(acc), o.to(acc)
        k, v = _expand(k.to(acc), groups), _expand(v.to(acc), groups)
        p, _ = self._probs(q, k, lse.to(acc), scale, causal)
        delta = (do * o).sum(-1, keepdim=True)
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, k) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q) * scale
        return dq, _fold(dk, groups), _fold(dv, groups)


class SdpaKernel:
    """ATen's fused attention with lse: flash-for-CPU (GQA native) or CUDA memory-efficient."""

    name = "sdpa"

    def forward(self, q, k, v, scale, causal):
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand(k, groups), _expand(v, groups), None, True, 0.0, causal, scale=scale)
        # The CUDA kernel pads lse's row dim to a multiple of 32.
        return o, lse[..., :q.shape[2]]

    def backward(self, do, q, k, v, o, lse, scale, causal):
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, o, lse, 0.0, causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        pad = math.ceil(q.shape[2] / 32) * 32 - q.shape[2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, _expand(k, groups), _expand(v, groups), None, o, F.pad(lse, (0, pad)), seed, seed,
            0.0, [True, True, True, False], causal, scale=scale)
        return dq, _fold(dk, groups), _fold(dv, groups)


class FlashKernel:
    """The flash-attn package (CUDA, fp16/bf16, GQA native); layout [b, s, h, d] inside.

    flash-attn's private ``_flash_attn_forward/_backward`` change signature between releases, so
    arguments are passed by name against the installed signature (as ring-flash-attention does).
    """

    name = "flash"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fa

        self._fwd, self._bwd = fa._flash_attn_forward, fa._flash_attn_backward
        self._fwd_params = inspect.signature(self._fwd).parameters
        self._bwd_params = inspect.signature(self._bwd).parameters

    # Arguments WallFacer never varies, by the names the flash-attn releases have used.
    _FIXED: ClassVar[dict] = {"window_size_left": -1, "window_size_right": -1, "window_size": (-1, -1),
                               "softcap": 0.0, "alibi_slopes": None, "return_softmax": False,
                               "deterministic": False, "rng_state": None, "dropout_p": 0.0}

    def _call(self, fn, params, **given):
        kwargs = {}
        for name, p in params.items():
            if name in given:
                kwargs[name] = given[name]
            elif name in self._FIXED:
                kwargs[name] = self._FIXED[name]
            elif p.default is inspect.Parameter.empty:
                raise TypeError(f"flash-attn's {fn.__name__} needs {name!r}, which WallFacer does not pass")
        return fn(**kwargs)

    def forward(self, q, k, v, scale, causal):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self._call(self._fwd, self._fwd_params, q=q, k=k, v=v, softmax_scale=scale, causal=causal)
        # flash-attn < 2.6 returns (out, q, k, v, out_padded, lse, S_dmask, rng), later (out, lse, S, rng)
        lse = out[5] if len(out) == 8 else out[1]
        return out[0].transpose(1, 2), lse

    def backward(self, do, q, k, v, o, lse, scale, causal):
        do, q, k, v, o = (t.transpose(1, 2).contiguous() for t in (do, q, k, v, o))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._call(self._bwd, self._bwd_params, dout=do, q=q, k=k, v=v, out=o, softmax_lse=lse,
                   dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def have_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_kernel(name: str, device: torch.device, dtype: torch.dtype):
    """The kernel object for ``name`` ("auto" resolves by device, dtype and what is installed)."""
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is not one of {KERNELS}")
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if device.type == "cuda":
            name = "flash" if half and have_flash_attn() else "sdpa"
        else:
            name = "sdpa" if device.type == "cpu" and not half else "reference"
    if name == "flash":
        if device.type != "cuda" or not half:
            raise ValueError(f"kernel='flash' needs CUDA fp16/bf16 tensors, got {device.type} {dtype}")
        if not have_flash_attn():
            raise ValueError("kernel='flash' needs the flash-attn package, which is not installed")
        return FlashKernel()
    if name == "sdpa":
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kernel='sdpa' runs on cpu or cuda, got {device.type}")
        return SdpaKernel()
    return ReferenceKernel()
