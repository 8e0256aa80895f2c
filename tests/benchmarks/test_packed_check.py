"""benchmarks/packed_check.py, the GPU check's packed-sequence step, with the GPU path's code: FlashKernel's
varlen path against the strict stand-in of flash-attn's varlen functions (any layout violation raises). Its
CPU twin (ATen's CPU flash kernel and the reference, one call per document, ``--quick``) runs in the GPU
check's dry run (tests/benchmarks/test_gpu_check.py)."""

from benchmarks import packed_check
from megatron_patches.block import FlashKernel, SdpaKernel
from tests.megatron_patches.strict_kernels import StrictFlashVarlen

SHORT = packed_check.QUICK_LENGTHS


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
