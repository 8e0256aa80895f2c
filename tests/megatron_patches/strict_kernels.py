"""Strict stand-ins for the libraries under WallFacer's GPU block kernels, runnable on CPU tensors.

``StrictFlashAttn`` has flash-attn 2.6+'s private ``_flash_attn_forward`` / ``_flash_attn_backward``
signatures; ``StrictEfficientOps`` has ATen's ``_scaled_dot_product_efficient_attention`` and its
backward. Each call first checks the layout contract the real CUDA code requires (block.py's
docstring: the head dim's stride 1, fp16/bf16 (flash) or fp16/bf16/fp32 (efficient), a *contiguous*
fp32 lse — mha_bwd reads it by raw pointer —, K/V heads expanded for the efficient kernel, causal
only on square blocks, no dropout, in-place gradient buffers of the right shape) and raises
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
