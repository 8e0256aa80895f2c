"""Runs ``python -m megatron_patches.megatron_lm`` on CPU ranks: test-only shims for Megatron-LM's training
loop without a GPU. They move no arithmetic: they point Megatron-LM's device calls at the CPU.

    MEGATRON_LM_PATH=... CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 4 \\
        tests/megatron_patches/megatron_lm_cpu.py <the arguments of megatron_patches.megatron_lm>
"""

import contextlib
import functools
import runpy
import sys

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


class CudaIsCpu(TorchFunctionMode):
    """Every torch call that names a CUDA device (``device="cuda"``, ``.to("cuda")``, ``.cuda()``) gets
    the CPU instead; nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    """CPU work is ordered already: a stream that waits for nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _shim() -> None:
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    from megatron.core import tensor_parallel

    # Megatron-LM's own switch for CPU-only use (it skips its CUDA assertion).
    training.initialize_megatron = functools.partial(training.initialize_megatron, allow_no_cuda=True)
    arguments.get_device_arch_version = lambda: 0  # no GPU architecture: the pre-Blackwell branches
    fused_kernels.load = lambda args: None  # CUDA softmax kernels (nvcc); the run has fusions off
    initialize._warmup_jit_function = lambda: None  # warms CUDA JIT fusions up on "cuda" tensors
    # One "device" that is the CPU: Megatron-LM initialises its model-parallel groups only when it sees one.
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    CudaIsCpu().__enter__()
    # CUDA RNG tracker: CPU RNG (dropout is 0 in the run; weights come from --use-cpu-initialization).
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None

    class _CpuTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    tensor_parallel.random.get_cuda_rng_tracker = lambda *a, **k: _CpuTracker()
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker


def main() -> None:
    from megatron_patches import megatron_lm

    root = megatron_lm.megatron_lm_path()
    sys.path.insert(0, str(root))
    _shim()
    if sys.argv[1:2] == ["--stock"]:
        sys.argv = [str(root / "pretrain_gpt.py"), *sys.argv[2:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        megatron_lm.main(sys.argv[1:])


if __name__ == "__main__":
    main()
