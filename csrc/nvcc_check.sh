#!/usr/bin/env bash
# Compile check of the CUDA sources on a machine without a GPU or a CUDA build of torch
# (design/traps.md, "CUDA compile check without a CUDA torch"):
#   1. every csrc/*.cu with nvcc alone, for sm_90 (they include only CUDA's headers), with the
#      half/bfloat16 restrictions torch's CUDAExtension builds with;
#   2. the torch glue csrc/*_cuda.cpp with the host compiler, syntax only, against the installed torch's
#      headers, with a stand-in for c10/cuda/impl/cuda_cmake_macros.h, the one generated header a CPU
#      wheel lacks. Skipped, with the reason, when torch cannot be imported.
# Usage: bash csrc/nvcc_check.sh   (PYTHON=... picks the interpreter whose torch is used; default python)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
arch="${NVCC_ARCH:-sm_90}"
python="${PYTHON:-python}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

torch_nvcc_defines=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
                    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
for cu in "$here"/*.cu; do
    nvcc -c -std=c++17 -arch="$arch" "${torch_nvcc_defines[@]}" -Xcompiler -Wall \
        -o "$scratch/$(basename "$cu").o" "$cu"
    echo "nvcc -arch=$arch: $(basename "$cu") ok"
done

torch_includes="$("$python" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))' 2>/dev/null)" || {
    echo "torch not importable with $python: syntax check of the *_cuda.cpp glue skipped"
    exit 0
}
cuda_include="$(nvcc --dryrun -c "$here/dispatch_cuda.cu" 2>&1 | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1)"
if [[ ! -f "$cuda_include/cuda_runtime.h" ]]; then
    echo "nvcc --dryrun named no include folder with cuda_runtime.h (got '$cuda_include')" >&2
    exit 1
fi
mkdir -p "$scratch/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$scratch/stub/c10/cuda/impl/cuda_cmake_macros.h"
flags=(-fsyntax-only -std=c++20 -DCOMMWEAVE_WITH_CUDA -I"$scratch/stub" -I"$cuda_include" -I"$here")
for inc in $torch_includes; do
    flags+=(-I"$inc")
done
for glue in "$here"/*_cuda.cpp; do
    "${CXX:-c++}" "${flags[@]}" -Wno-c++20-extensions "$glue"
    echo "c++ -fsyntax-only: $(basename "$glue") ok"
done
