"""commweave: communication schedules for DeepSpeed and Megatron (Parm, WallFacer, ATLAS).

Builds the extension ``ds_plugins._C`` from csrc/ against the torch already installed here, so install
torch first and build without isolation::

    pip install torch==2.13.0
    pip install --no-build-isolation -e '.[test]'

C++ CPU kernels are always built. CUDA kernels are added when torch is a CUDA build and a CUDA
toolkit is found; ``COMMWEAVE_CUDA=1`` forces them (and fails if they cannot be built),
``COMMWEAVE_CUDA=0`` skips them. ``TORCH_CUDA_ARCH_LIST`` picks the GPU targets (e.g. ``9.0``).
A failing compile fails the install: there is no silent fallback at build time.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("commweave builds a C++ extension against the torch installed in this environment.\n"
             "Install torch first (pip install torch==2.13.0 for the CPU build), then install commweave "
             "with: pip install --no-build-isolation -e .")


BUBBLETEA = ["transformers>=4.56", "safetensors>=0.4", "aiohttp>=3.9"]


def _want_cuda() -> bool:
    flag = os.environ.get("COMMWEAVE_CUDA", "auto").lower()
    if flag not in ("auto", "0", "1"):
        sys.exit(f"COMMWEAVE_CUDA={flag!r}: use 0 (CPU kernels only), 1 (CUDA required) or auto")
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "1" and not possible:
        sys.exit(f"COMMWEAVE_CUDA=1 but torch {torch.__version__} is "
                 f"{'a CPU build' if torch.version.cuda is None else 'a CUDA build'} and CUDA_HOME is "
                 f"{CUDA_HOME!r}: install a CUDA build of torch and a CUDA toolkit, or use COMMWEAVE_CUDA=0")
    return possible if flag == "auto" else flag == "1"


def _extension():
    here = os.path.dirname(os.path.abspath(__file__))
    cpp = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))
    cuda_glue = [p for p in cpp if p.endswith("_cuda.cpp")]
    common = [p for p in cpp if p not in cuda_glue]
    # -fopenmp: at::parallel_for is inline in torch's headers and runs on one thread unless the
    # extension itself is compiled with OpenMP (it then joins torch's OpenMP pool, libgomp.so.1).
    # No -std: torch's build helpers pick the standard its headers need (C++20 for torch 2.13).
    cxx = ["-O3", "-fopenmp"]
    link = ["-fopenmp"]
    if _want_cuda():
        cu = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cu")))
        return CUDAExtension(
            "ds_plugins._C", common + cuda_glue + cu,
            define_macros=[("COMMWEAVE_WITH_CUDA", "1")], extra_link_args=link,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]})
    return CppExtension("ds_plugins._C", common, extra_compile_args={"cxx": cxx}, extra_link_args=link)


setup(
    name="commweave",
    version="0.1.0",
    description="Communication schedules for DeepSpeed and Megatron: Parm MoE, WallFacer attention, "
                "ATLAS launcher",
    packages=find_packages(include=["commweave", "commweave.*", "ds_plugins", "ds_plugins.*",
                                    "megatron_patches", "megatron_patches.*", "launch", "launch.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.19.0", "megatron-core>=0.16.1", "numpy", "tqdm",
                      "matplotlib"],
    # bubbletea: Hugging Face models (launch.bubbletea.hf) and the HTTP endpoint (launch.bubbletea.endpoint)
    extras_require={"bubbletea": BUBBLETEA,
                    "test": ["pytest>=8", "pytest-timeout", "ruff", "hypothesis>=6", *BUBBLETEA]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    entry_points={"console_scripts": ["deepspeed-atlas=launch.run.runner:main"]},
)
