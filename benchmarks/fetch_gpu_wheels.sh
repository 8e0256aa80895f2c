#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels benchmarks/gpu_check.sh installs on the GPU machine, which
# reaches no package index: Python 3.12, manylinux x86_64 (device tool README, "Notes"). The list is
# benchmarks/gpu_wheels.py; deepspeed publishes only an sdist, so its pure-Python wheel is built here
# (no ops prebuilt) with the torch of this environment. Ends by checking that the set resolves.
# Usage, from any folder, on a machine with network access:  bash benchmarks/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
dest=.whl
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
while read -r spec; do
    if [[ "$spec" == deepspeed==* ]]; then
        DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$spec"
    else
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d "$dest" "$spec"
    fi
    echo "fetched $spec"
done < <("$python" -m benchmarks.gpu_wheels --list)
"$python" -m benchmarks.gpu_wheels --check "$dest"
du -sh "$dest"
