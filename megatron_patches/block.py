"""One attention block with its log-sum-exp: the compute kernel under WallFacer's ring loop.

Shape legend: b batch, h query heads, g K/V heads (h % g == 0, query head j reads K/V head
j // (h/g), Megatron's GQA convention), s query rows, t key rows, d head dim.

    forward(q_bhsd, k_bgtd, v_bgtd, scale, causal)          -> o_bhsd, lse_bhs
    backward(do_bhsd, q, k, v, o_bhsd, lse_bhs, scale, causal) -> dq_bhsd, dk_bgtd, dv_bgtd

lse_bhs = log Σ_t exp(scale·q·k_t) per row. ``causal`` masks key t > query s (both blocks start at
the same position; WallFacer only asks for it on square blocks). ``backward`` takes the *final*
output and lse of the whole row (not the block's): then P = exp(scale·q·kᵀ − lse) is the block's
slice of the global softmax, and with D = rowsum(dO∘O) (FlashAttention-2, Alg. 2)

    dV = Pᵀ·dO,   dS = P∘(dO·Vᵀ − D),   dQ = scale·dS·K,   dK = scale·dSᵀ·Q

are exactly this block's contributions to the gradients of the full attention.

What a kernel object is given (wallfacer.py): q, k, v, do, o are [b, h, s, d] *views* of Megatron's
[s, b, h, d] memory, row ranges of it: any strides, the head dim's stride 1; lse is a row range of
a [b, h, C·s] accumulator (strided, fp32 — fp64 for fp64 inputs). Each kernel brings them into what
its library requires before calling it (tests/megatron_patches/test_kernel_contract.py checks every
call of a forward and backward against strict stand-ins of these libraries):

    flash      flash-attn 2.x mha_fwd / mha_bwd: [b, s, h, d] with stride(d) = 1 (a transpose of the
               view, no copy); fp16/bf16; d a multiple of 8, at most 256; softmax_lse fp32
               [b, h, s] *contiguous* (mha_bwd reads it by raw pointer, unchecked); dq, dk, dv
               written in place with stride(d) = 1; causal only on square blocks (flash-attn
               aligns a causal mask bottom-right). GQA native.
    sdpa/cuda  ATen's memory-efficient attention: [b, h, s, d] with stride(d) = 1, K/V heads expanded
               (no GQA), fp16/bf16/fp32; logsumexp fp32 [b, h, ⌈s/32⌉·32] contiguous (the kernel's
               padding), causal on square blocks (top-left).
    sdpa/cpu   ATen's flash attention for CPU: any strides (it reads them); lse passed contiguous.
    reference  explicit matrices in fp32 (fp64 for fp64 inputs): any layout; the oracle and the
               fallback.

``select_kernel("auto", ...)`` picks flash-attn when it imports and fits, else sdpa — except 16-bit
inputs on CPU, where ATen's flash backward is both slower than the fp32 reference (2.6-2.9x,
256-1024 rows, 8 heads) and less accurate (dV error 2.1x that of naive bf16 attention), and fp64 on
CUDA, which neither fused kernel takes: the reference there.

Determinism (``deterministic=True``, Megatron's ``deterministic_mode``): flash runs flash-attn's
deterministic backward (``deterministic=True``: dK/dV accumulated in a fixed order); sdpa on CUDA runs
its backward with torch's deterministic algorithms on (the memory-efficient kernel then uses one key
split instead of atomic adds across splits); sdpa on CPU and the reference are deterministic anyway
(ATen's CPU flash backward parallelises over batch x heads only). The forwards are deterministic.
WallFacer's own sums run in a fixed order (ring order, team reduce-scatter).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
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


def _lse_for_library(lse: torch.Tensor, rows: int = 0, keep_dtype: bool = False) -> torch.Tensor:
    """lse as fused kernels read it: fp32 (or its own dtype), contiguous, zero-padded to ``rows`` rows."""
    lse = lse if keep_dtype else lse.float()
    pad = rows - lse.shape[-1]
    return F.pad(lse, (0, pad)) if pad > 0 else lse.contiguous()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@contextlib.contextmanager
def _deterministic_algorithms(on: bool):
    """torch's deterministic-algorithm switch set to ``on`` for the block, then restored."""
    if not on or (torch.are_deterministic_algorithms_enabled()
                  and not torch.is_deterministic_algorithms_warn_only_enabled()):
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


class SdpaKernel:
    """ATen's fused attention with lse: flash-for-CPU (GQA native) or CUDA memory-efficient.

    ``ops`` is the namespace of the ATen ops (``torch.ops.aten``); ``cuda`` forces the CUDA path's
    arguments (default: the tensors' device decides) — both so that a test can hold the CUDA path
    to its contract on CPU tensors.
    """

    name = "sdpa"

    def __init__(self, deterministic: bool = False, ops=None, cuda: bool | None = None) -> None:
        self.deterministic, self._ops, self._cuda = deterministic, ops or torch.ops.aten, cuda

    def _on_cuda(self, q: torch.Tensor) -> bool:
        return q.device.type == "cuda" if self._cuda is None else self._cuda

    def forward(self, q, k, v, scale, causal):
        if not self._on_cuda(q):
            return self._ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        q, k, v = (_last_dim_contiguous(t) for t in (q, _expand(k, groups), _expand(v, groups)))
        o, lse, _, _ = self._ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                         scale=scale)
        # The CUDA kernel pads lse's row dim to a multiple of 32.
        return o, lse[..., :q.shape[2]]

    def backward(self, do, q, k, v, o, lse, scale, causal):
        if not self._on_cuda(q):
            return self._ops._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, o, _lse_for_library(lse, keep_dtype=True), 0.0, causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        do, q, o = (_last_dim_contiguous(t) for t in (do, q, o))
        k, v = (_last_dim_contiguous(_expand(t, groups)) for t in (k, v))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        with _deterministic_algorithms(self.deterministic):
            dq, dk, dv, _ = self._ops._scaled_dot_product_efficient_attention_backward(
                do, q, k, v, None, o, _lse_for_library(lse, math.ceil(q.shape[2] / 32) * 32), seed, seed,
                0.0, [True, True, True, False], causal, scale=scale)
        return dq, _fold(dk, groups), _fold(dv, groups)


class FlashKernel:
    """The flash-attn package (CUDA, fp16/bf16, GQA native); layout [b, s, h, d] inside.

    flash-attn's private ``_flash_attn_forward/_backward`` change signature between releases, so
    arguments are passed by name against the installed signature (as ring-flash-attention does).
    ``interface`` is the module holding them (default ``flash_attn.flash_attn_interface``).
    """

    name = "flash"

    def __init__(self, deterministic: bool = False, interface=None) -> None:
        if interface is None:
            from flash_attn import flash_attn_interface as interface
        self.deterministic = deterministic
        self._fwd, self._bwd = interface._flash_attn_forward, interface._flash_attn_backward
        self._fwd_params = inspect.signature(self._fwd).parameters
        self._bwd_params = inspect.signature(self._bwd).parameters
        # Varlen (many blocks in one call: a packed batch's documents, forward_calls): flash-attn 2.x's
        # _flash_attn_varlen_forward / _backward, [total, h, d] with int32 cu_seqlens.
        self.varlen = hasattr(interface, "_flash_attn_varlen_forward")
        if self.varlen:
            self._vfwd = interface._flash_attn_varlen_forward
            self._vbwd = interface._flash_attn_varlen_backward
            self._vfwd_params = inspect.signature(self._vfwd).parameters
            self._vbwd_params = inspect.signature(self._vbwd).parameters

    # Arguments WallFacer never varies, by the names the flash-attn releases have used.
    _FIXED: ClassVar[dict] = {"window_size_left": -1, "window_size_right": -1, "window_size": (-1, -1),
                               "softcap": 0.0, "alibi_slopes": None, "return_softmax": False,
                               "rng_state": None, "dropout_p": 0.0}

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
        q, k, v = (_last_dim_contiguous(t.transpose(1, 2)) for t in (q, k, v))
        out = self._call(self._fwd, self._fwd_params, q=q, k=k, v=v, softmax_scale=scale, causal=causal)
        # flash-attn < 2.6 returns (out, q, k, v, out_padded, lse, S_dmask, rng), later (out, lse, S, rng)
        lse = out[5] if len(out) == 8 else out[1]
        return out[0].transpose(1, 2), lse

    def backward(self, do, q, k, v, o, lse, scale, causal):
        do, q, k, v, o = (_last_dim_contiguous(t.transpose(1, 2)) for t in (do, q, k, v, o))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._call(self._bwd, self._bwd_params, dout=do, q=q, k=k, v=v, out=o,
                   softmax_lse=_lse_for_library(lse), dq=dq, dk=dk, dv=dv, softmax_scale=scale,
                   causal=causal, deterministic=self.deterministic)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def forward_varlen(self, q, k, v, segs, scale, causal):
        """Blocks ``segs`` = [(q0, q1, k0, k1)] of [b, h, ·, d] views in one call: O [b, h, Σq, d] and lse
        [b, h, Σq] over the query segments one after the other (batch rows are segments too)."""
        (qv,), cu = _varlen_pack(segs, q)
        (kv, vv), _ = _varlen_pack(segs, k, v, keys=True)
        out = self._call(self._vfwd, self._vfwd_params, q=qv, k=kv, v=vv, **cu, softmax_scale=scale,
                         causal=causal)
        lse = out[5] if len(out) == 8 else out[1]
        nq = qv.shape[0] // q.shape[0]
        self._padded_lse = lse.dim() == 3  # flash-attn < 2.5: [segments, h, max_seqlen_q], per segment
        if self._padded_lse:
            lse = torch.cat([lse[i, :, :n] for i, n in enumerate(cu["lengths_q"])], 1)
        return (_varlen_unpack(out[0], q.shape[0]), lse.view(lse.shape[0], q.shape[0], nq).permute(1, 0, 2))

    def backward_varlen(self, do, q, k, v, o, lse, segs, scale, causal):
        """The gradients of forward_varlen's blocks: dQ [b, h, Σq, d] (query segments in order), dK, dV
        [b, g, Σk, d] (key segments in order; a key row in two segments is in both)."""
        (dov, qv, ov), cu = _varlen_pack(segs, do, q, o)
        (kv, vv), _ = _varlen_pack(segs, k, v, keys=True)
        lse_q = torch.cat([lse[:, :, a:b] for a, b, _, _ in segs], 2)  # [b, h, Σq]
        lse_v = lse_q.permute(1, 0, 2).reshape(lse.shape[1], -1).float().contiguous()  # [h, b·Σq]
        if getattr(self, "_padded_lse", False):  # as this flash-attn's forward returned it
            lse_v = _varlen_lse_padded(lse_v, cu["lengths_q"], cu["max_seqlen_q"])
        dq, dk, dv = torch.empty_like(qv), torch.empty_like(kv), torch.empty_like(vv)
        self._call(self._vbwd, self._vbwd_params, dout=dov, q=qv, k=kv, v=vv, out=ov, softmax_lse=lse_v,
                   dq=dq, dk=dk, dv=dv, **cu, softmax_scale=scale, causal=causal,
                   deterministic=self.deterministic)
        b = q.shape[0]
        return _varlen_unpack(dq, b), _varlen_unpack(dk, b), _varlen_unpack(dv, b)


def _varlen_pack(segs, *ts, keys: bool = False):
    """Segments of [b, heads, rows, d] views (query rows of ``segs``, or key rows with ``keys``) as flash
    varlen tensors [b·Σ, heads, d] (batch row after batch row), and the cumulative lengths of the b·n
    segments (int32) with the longest segment, as the library's keyword arguments."""
    b = ts[0].shape[0]
    ranges = [(k0, k1) if keys else (q0, q1) for q0, q1, k0, k1 in segs]
    packed = [torch.cat([t[:, :, a:z] for a, z in ranges], 2).transpose(1, 2).reshape(-1, *t.shape[1:2],
                                                                                        t.shape[3])
              for t in ts]
    packed = [p if p.is_contiguous() else p.contiguous() for p in packed]
    lq, lk = [q1 - q0 for q0, q1, _, _ in segs], [k1 - k0 for _, _, k0, k1 in segs]
    device = ts[0].device
    cu = {"cu_seqlens_q": _cumulative(lq * b, device), "cu_seqlens_k": _cumulative(lk * b, device),
          "max_seqlen_q": max(lq), "max_seqlen_k": max(lk), "lengths_q": lq * b}
    return packed, cu


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _varlen_unpack(t: torch.Tensor, b: int) -> torch.Tensor:
    """[b·Σ, heads, d] → [b, heads, Σ, d] (a view)."""
    return t.view(b, -1, *t.shape[1:]).transpose(1, 2)


def _varlen_lse_padded(lse: torch.Tensor, lengths: list[int], longest: int) -> torch.Tensor:
    """[h, total] → flash-attn < 2.5's [segments, h, longest], zero-padded."""
    out = lse.new_zeros(len(lengths), lse.shape[0], longest)
    for i, (a, n) in enumerate(zip(itertools.accumulate([0, *lengths]), lengths, strict=False)):
        out[i, :, :n] = lse[:, a:a + n]
    return out


def _groups(kernel, calls):
    """The calls as kernel invocations: one varlen call per mask kind (full, causal diagonal) when the
    kernel has one and there are several, else one call each, in order."""
    if not getattr(kernel, "varlen", False):
        return [(c[4], [c]) for c in calls]
    out = []
    for diag in (False, True):
        group = [c for c in calls if c[4] == diag]
        if len(group) > 1:
            out.append((diag, group))
        else:
            out += [(diag, [c]) for c in group]
    return out


def forward_calls(kernel, q, k, v, calls, scale):
    """(call, O, lse) of each block call (q0, q1, k0, k1, diagonal) of [b, h, ·, d] views (rowmap.py):
    a packed batch's documents go to a varlen kernel together."""
    for diag, group in _groups(kernel, calls):
        if len(group) == 1:
            q0, q1, k0, k1, _ = group[0]
            yield (group[0], *kernel.forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale, diag))
            continue
        o, lse = kernel.forward_varlen(q, k, v, [c[:4] for c in group], scale, diag)
        for c, off in zip(group, itertools.accumulate([0] + [c[1] - c[0] for c in group]), strict=False):
            yield c, o[:, :, off:off + c[1] - c[0]], lse[:, :, off:off + c[1] - c[0]]


def backward_calls(kernel, do, q, k, v, o, lse, calls, scale):
    """(call, dQ, dK, dV) of each block call, as forward_calls; dK, dV over the call's key rows."""
    for diag, group in _groups(kernel, calls):
        if len(group) == 1:
            q0, q1, k0, k1, _ = group[0]
            rows, keys = slice(q0, q1), slice(k0, k1)
            yield (group[0], *kernel.backward(do[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                              o[:, :, rows], lse[:, :, rows], scale, diag))
            continue
        dq, dk, dv = kernel.backward_varlen(do, q, k, v, o, lse, [c[:4] for c in group], scale, diag)
        qo = itertools.accumulate([0] + [c[1] - c[0] for c in group])
        ko = itertools.accumulate([0] + [c[3] - c[2] for c in group])
        for c, a, z in zip(group, qo, ko, strict=False):
            n, m = c[1] - c[0], c[3] - c[2]
            yield c, dq[:, :, a:a + n], dk[:, :, z:z + m], dv[:, :, z:z + m]


def have_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_fits(head_dim: int | None) -> bool:
    """flash-attn 2.x takes head dims that are multiples of 8, up to 256 (None: not known yet)."""
    return head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)


def select_kernel(name, device: torch.device, dtype: torch.dtype, deterministic: bool = False,
                  head_dim: int | None = None):
    """The kernel object for ``name`` ("auto" resolves by device, dtype, head dim and what is installed).

    ``name`` may also be a kernel object (``forward``/``backward`` as above), used as it is.
    """
    if not isinstance(name, str):
        if not (callable(getattr(name, "forward", None)) and callable(getattr(name, "backward", None))):
            raise ValueError(f"kernel={name!r} is neither one of {KERNELS} nor a kernel object")
        return name
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is not one of {KERNELS}")
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if device.type == "cuda":
            flash = half and have_flash_attn() and flash_fits(head_dim)
            name = "flash" if flash else "reference" if dtype == torch.float64 else "sdpa"
        else:
            name = "sdpa" if device.type == "cpu" and not half else "reference"
    if name == "flash":
        if device.type != "cuda" or not half:
            raise ValueError(f"kernel='flash' needs CUDA fp16/bf16 tensors, got {device.type} {dtype}")
        if not have_flash_attn():
            raise ValueError("kernel='flash' needs the flash-attn package, which is not installed")
        if not flash_fits(head_dim):
            raise ValueError(f"kernel='flash' needs a head dim that is a multiple of 8 and at most 256, "
                             f"got {head_dim}")
        return FlashKernel(deterministic)
    if name == "sdpa":
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kernel='sdpa' runs on cpu or cuda, got {device.type}")
        if device.type == "cuda" and dtype == torch.float64:
            raise ValueError("kernel='sdpa' on CUDA takes fp16, bf16 or fp32 (the memory-efficient kernel), "
                             "got float64: use kernel='reference'")
        return SdpaKernel(deterministic)
    return ReferenceKernel()
