"""benchmarks/packed_check.py, the GPU check's packed-sequence step, runs here as its CPU twin (ATen's CPU
flash kernel and the reference, one call per document) and with the GPU path's code: FlashKernel's varlen
path against the strict stand-in of flash-attn's varlen functions (any layout violation raises)."""

import pytest

from benchmarks import packed_check
from megatron_patches.block import FlashKernel, SdpaKernel
from tests.megatron_patches.strict_kernels import StrictFlashVarlen

SHORT = [90, 1, 37, 4, 17]  # a smaller batch of the same kinds (odd lengths, a 1-token document)


@pytest.mark.slow
def test_cpu_twin_passes():
    summary = packed_check.run("cpu", lengths=SHORT, timed=False)
    assert summary["passed"] and summary["cases"] == 6, summary


def test_flash_varlen_path_with_the_strict_stand_in():
    lib = StrictFlashVarlen()
    summary = packed_check.run("cpu", {"flash": (FlashKernel(interface=lib), ("bf16",))}, SHORT, timed=False)
    assert summary["passed"], summary
    assert {c["fn"] for c in lib.calls} == {"varlen_forward", "varlen_backward"}
    assert all(c["segments"] == len(SHORT) for c in lib.calls)  # every document in one call


def test_a_wrong_kernel_fails_the_check():
    class Off(SdpaKernel):
        def backward(self, *args):
            dq, dk, dv = super().backward(*args)
            return dq, dk * 1.01, dv

    summary = packed_check.run("cpu", {"off": (Off(), ("fp32",))}, SHORT, timed=False)
    assert not summary["passed"] and len(summary["failed"]) == 2
