"""benchmarks/block_check.py, the GPU check's WallFacer block step, runs here as its CPU twin: ATen's CPU
flash kernel and the reference, and the GPU paths' code (FlashKernel, SdpaKernel's CUDA path) against
the strict stand-ins of flash-attn and ATen's memory-efficient attention (any layout violation raises)."""

import pytest
import torch

from benchmarks import block_check
from megatron_patches.block import FlashKernel, SdpaKernel
from tests.megatron_patches.strict_kernels import StrictEfficientOps, StrictFlashAttn


@pytest.mark.slow
def test_cpu_twin_passes():
    summary = block_check.run("cpu", s=64)
    assert summary["passed"] and summary["cases"] == 12, summary


@pytest.mark.slow
def test_gpu_paths_with_strict_stand_ins():
    flash, efficient = StrictFlashAttn(), StrictEfficientOps()
    kernels = {"flash": (FlashKernel(interface=flash), ("bf16", "fp16")),
               "sdpa-cuda": (SdpaKernel(ops=efficient, cuda=True), ("bf16", "fp32"))}
    summary = block_check.run("cpu", kernels, s=64)
    assert summary["passed"], summary
    assert {c["fn"] for c in flash.calls} == {c["fn"] for c in efficient.calls} == {"forward", "backward"}


def test_a_wrong_kernel_fails_the_check():
    class Off(SdpaKernel):
        def backward(self, *args):
            dq, dk, dv = super().backward(*args)
            return dq * 1.01, dk, dv

    summary = block_check.run("cpu", {"off": (Off(), ("fp32",))}, s=64)
    assert not summary["passed"] and len(summary["failed"]) == 4


def test_cli_refuses_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        block_check.main(["--device", "cuda"])
