"""Strict stand-ins for the libraries under WallFacer's GPU block kernels, runnable on CPU tensors.

``StrictFlashAttn`` has flash-attn 2.6+'s private ``_flash_attn_forward`` / ``_flash_attn_backward``
signatures (``StrictFlashVarlen`` adds ``_flash_attn_varlen_forward`` / ``_backward``);
``StrictEfficientOps`` has ATen's ``_scaled_dot_product_efficient_attention`` and its backward. Each
call first checks the layout contract the real CUDA code requires (block.py's docstring: the head
dim's stride 1, fp16/bf16 (flash) or fp16/bf16/fp32 (efficient), a *contiguous* fp32 lse — mha_bwd
reads it by raw pointer —, K/V heads expanded for the efficient kernel, causal only on square
blocks, no dropout, in-place gradient buffers of the right shape) and raises
``ContractError`` on any violation; then it computes the block in fp64 with the reference kernel's
maths and returns results in the dtypes the real kernel returns. Every call is recorded.

``raises=False`` records a violation in ``violations`` instead and goes on: in a multi-rank run a
rank that raised mid-backward would leave the others waiting in a collective until the timeout.
"""

from __future__ import annotations

import math

import torch

from megatron_patches.block import ReferenceKernel


class ContractError(AssertionError):
    pass


class _Strict:
    def __init__(self, raises: bool = True) -> None:
        self.raises, self.calls, self.violations = raises, [], []

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            if self.raises:
                raise ContractError(what)
            self.violations.append(what)

    def _last_dim(self, name: str, t: torch.Tensor) -> None:
        self._require(t.stride(-1) == 1, f"{name}: the last dim must have stride 1, strides {t.stride()}")

    def _causal_square(self, causal: bool, sq: int, sk: int) -> None:
        self._require(not causal or sq == sk,
                      f"causal on a {sq}x{sk} block: the library aligns the mask differently")


class StrictFlashAttn(_Strict):
    """flash-attn 2.x: q [b, sq, h, d], k/v [b, sk, g, d] (h % g == 0), lse [b, h, sq] fp32."""

    HALF = (torch.float16, torch.bfloat16)

    def _inputs(self, q, k, v, causal, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes):
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._require(t.dim() == 4, f"{name} must be 4-d [b, s, h, d], got {tuple(t.shape)}")
            self._require(t.dtype in self.HALF, f"{name}: flash-attn takes fp16/bf16, got {t.dtype}")
            self._require(t.dtype == q.dtype and t.device == q.device, f"{name}: dtype/device unlike q's")
            self._last_dim(name, t)
        b, sq, h, d = q.shape
        self._require(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d and h % k.shape[2] == 0,
                 f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
        self._require(d % 8 == 0 and d <= 256, f"head dim {d}: a multiple of 8, at most 256")
        self._causal_square(causal, sq, k.shape[1])
        self._require(dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
                 and window_size_left == -1 and window_size_right == -1, "unexpected dropout/window/softcap")

    @staticmethod
    def _bhsd(t):
        return t.transpose(1, 2).double()

    def _flash_attn_forward(self, q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax):
        self._inputs(q, k, v, causal, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        o, lse = ReferenceKernel().forward(self._bhsd(q), self._bhsd(k), self._bhsd(v), softmax_scale, causal)
        self.calls.append({"fn": "forward", "causal": causal})
        return (o.transpose(1, 2).to(q.dtype).contiguous(), lse.float().contiguous(), None,
                torch.zeros(2, dtype=torch.int64))

    def _flash_attn_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                             causal, window_size_left, window_size_right, softcap, alibi_slopes,
                             deterministic, rng_state=None):
        self._inputs(q, k, v, causal, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        pairs = (("dout", dout, q), ("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v))
        for name, t, like in pairs:
            self._require(t.shape == like.shape and t.dtype == like.dtype, f"{name}: shape/dtype of input")
            self._last_dim(name, t)
        b, sq, h, _ = q.shape
        self._require(softmax_lse.dtype == torch.float32, f"softmax_lse fp32, got {softmax_lse.dtype}")
        self._require(tuple(softmax_lse.shape) == (b, h, sq), f"softmax_lse shape {tuple(softmax_lse.shape)}")
        self._require(softmax_lse.is_contiguous(), f"softmax_lse is read by raw pointer: must be contiguous, "
                                              f"strides {softmax_lse.stride()}")
        grads = ReferenceKernel().backward(self._bhsd(dout), self._bhsd(q), self._bhsd(k), self._bhsd(v),
                                           self._bhsd(out), softmax_lse.double(), softmax_scale, causal)
        for buf, g in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(g.transpose(1, 2))
        self.calls.append({"fn": "backward", "causal": causal, "deterministic": deterministic})
        return dq, dk, dv, None


class StrictFlashVarlen(StrictFlashAttn):
    """flash-attn 2.6+ with its varlen functions too: q [total_q, h, d], k/v [total_k, g, d], int32
    cu_seqlens, lse [h, total_q] fp32 (contiguous in the backward); causal only where every segment is
    square. ``padded_lse``: flash-attn < 2.5's varlen lse, [segments, h, max_seqlen_q]."""

    def __init__(self, raises: bool = True, padded_lse: bool = False) -> None:
        super().__init__(raises)
        self.padded_lse = padded_lse

    def _segments(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, softcap, alibi_slopes,
                  window_size_left, window_size_right):
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._require(t.dim() == 3, f"{name} must be 3-d [total, h, d], got {tuple(t.shape)}")
            self._require(t.dtype in self.HALF and t.dtype == q.dtype,
                          f"{name}: fp16/bf16 like q, got {t.dtype}")
            self._last_dim(name, t)
        for name, cu, t, top in (("cu_seqlens_q", cu_q, q, max_q), ("cu_seqlens_k", cu_k, k, max_k)):
            self._require(cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(),
                          f"{name}: a contiguous 1-d int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
            self._require(int(cu[0]) == 0 and int(cu[-1]) == t.shape[0],
                          f"{name} {cu.tolist()} vs {t.shape[0]} rows")
            self._require(int((cu[1:] - cu[:-1]).max()) <= top,
                          f"{name}: a segment longer than max_seqlen {top}")
        self._require(cu_q.shape == cu_k.shape, "as many query as key segments")
        lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        self._require(not causal or lq == lk, f"causal on non-square segments {lq} x {lk}")
        self._require(dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
                      and window_size_left == -1 and window_size_right == -1,
                      "unexpected dropout/window/softcap")
        return list(zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist(), strict=False))

    @staticmethod
    def _block(t, a, z):
        return t[a:z].transpose(0, 1).unsqueeze(0).double()  # [1, heads, n, d]

    def _flash_attn_varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p, softmax_scale, causal, window_size_left=-1,
                                   window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
                                   block_table=None):
        segs = self._segments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                              dropout_p, softcap, alibi_slopes, window_size_left, window_size_right)
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for q0, q1, k0, k1 in segs:
            o, l_ = ReferenceKernel().forward(self._block(q, q0, q1), self._block(k, k0, k1),
                                              self._block(v, k0, k1), softmax_scale, causal)
            out[q0:q1] = o[0].transpose(0, 1).to(q.dtype)
            lse[:, q0:q1] = l_[0]
        self.calls.append({"fn": "varlen_forward", "causal": causal, "segments": len(segs)})
        if self.padded_lse:
            lse = torch.stack([torch.nn.functional.pad(lse[:, a:z], (0, max_seqlen_q - (z - a)))
                               for a, z, _, _ in segs])
        return out, lse, None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                    causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                    deterministic, rng_state=None):
        segs = self._segments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                              dropout_p, softcap, alibi_slopes, window_size_left, window_size_right)
        pairs = (("dout", dout, q), ("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v))
        for name, t, like in pairs:
            self._require(t.shape == like.shape and t.dtype == like.dtype, f"{name}: shape/dtype of input")
            self._last_dim(name, t)
        want = (len(segs), q.shape[1], max_seqlen_q) if self.padded_lse else (q.shape[1], q.shape[0])
        self._require(softmax_lse.dtype == torch.float32 and tuple(softmax_lse.shape) == want
                      and softmax_lse.is_contiguous(), f"softmax_lse: contiguous fp32 {want}, got "
                      f"{tuple(softmax_lse.shape)} {softmax_lse.dtype} strides {softmax_lse.stride()}")
        for i, (q0, q1, k0, k1) in enumerate(segs):
            lse = softmax_lse[i, :, :q1 - q0] if self.padded_lse else softmax_lse[:, q0:q1]
            grads = ReferenceKernel().backward(self._block(dout, q0, q1), self._block(q, q0, q1),
                                               self._block(k, k0, k1), self._block(v, k0, k1),
                                               self._block(out, q0, q1), lse[None].double(), softmax_scale,
                                               causal)
            for buf, g, a, z in zip((dq, dk, dv), grads, (q0, k0, k0), (q1, k1, k1), strict=True):
                buf[a:z] = g[0].transpose(0, 1)
        self.calls.append({"fn": "varlen_backward", "causal": causal, "deterministic": deterministic,
                           "segments": len(segs)})
        return dq, dk, dv, None


class StrictEfficientOps(_Strict):
    """ATen's CUDA memory-efficient attention: [b, h, s, d], K/V heads equal to q's, padded fp32 lse."""

    DTYPES = (torch.float16, torch.bfloat16, torch.float32)

    def _inputs(self, q, k, v, causal, dropout_p, attn_bias):
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._require(t.dim() == 4 and t.dtype in self.DTYPES and t.dtype == q.dtype,
                     f"{name}: 4-d fp16/bf16/fp32 like q, got {tuple(t.shape)} {t.dtype}")
            self._last_dim(name, t)
        self._require(k.shape == v.shape and k.shape[1] == q.shape[1],
                 f"k {tuple(k.shape)}: the efficient kernel has no GQA, heads must equal q's {q.shape[1]}")
        self._causal_square(causal, q.shape[2], k.shape[2])
        self._require(dropout_p == 0.0 and attn_bias is None, "unexpected dropout or bias")

    @staticmethod
    def padded(rows: int) -> int:
        return math.ceil(rows / 32) * 32

    def _scaled_dot_product_efficient_attention(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p,
                                                is_causal, *, scale):
        self._inputs(q, k, v, is_causal, dropout_p, attn_bias)
        self._require(compute_log_sumexp, "WallFacer needs the lse")
        o, lse = ReferenceKernel().forward(q.double(), k.double(), v.double(), scale, is_causal)
        lse_pad = torch.full((*lse.shape[:2], self.padded(lse.shape[2])), float("inf"), dtype=torch.float32)
        lse_pad[..., :lse.shape[2]] = lse
        self.calls.append({"fn": "forward", "causal": is_causal})
        seed = torch.zeros((), dtype=torch.int64)
        return o.to(q.dtype), lse_pad, seed, seed

    def _scaled_dot_product_efficient_attention_backward(self, grad_out, q, k, v, attn_bias, out, logsumexp,
                                                         philox_seed, philox_offset, dropout_p,
                                                         grad_input_mask, is_causal, *, scale):
        self._inputs(q, k, v, is_causal, dropout_p, attn_bias)
        for name, t in (("grad_out", grad_out), ("out", out)):
            self._require(t.shape == q.shape and t.dtype == q.dtype, f"{name}: shape/dtype of q")
            self._last_dim(name, t)
        b, h, sq, _ = q.shape
        self._require(logsumexp.dtype == torch.float32 and tuple(logsumexp.shape) == (b, h, self.padded(sq)),
                 f"logsumexp must be fp32 [b, h, ceil(s/32)*32] = {(b, h, self.padded(sq))}, got "
                 f"{tuple(logsumexp.shape)} {logsumexp.dtype}")
        self._require(logsumexp.is_contiguous(), f"logsumexp must be contiguous: {logsumexp.stride()}")
        self._require(philox_seed.dtype == torch.int64 and list(grad_input_mask) == [True, True, True, False],
                 "philox seed/offset int64 and grad_input_mask [q, k, v, no bias]")
        grads = ReferenceKernel().backward(*(t.double() for t in (grad_out, q, k, v, out)),
                                           logsumexp[..., :sq].double(), scale, is_causal)
        self.calls.append({"fn": "backward", "causal": is_causal,
                           "deterministic": torch.are_deterministic_algorithms_enabled()})
        return (*(g.to(q.dtype) for g in grads), None)
