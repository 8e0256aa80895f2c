#!/usr/bin/env bash
# The prepared GPU check (issue 6): on the GPU machine that some sessions are lent (the device tool's
# nvidia-h200: Python 3.12, torch 2.11+cu130, nvcc 13.0, pytest, no deepspeed or megatron-core), in one
# short run from the repository root:
#   1. gpu      the GPU and torch's CUDA are there
#   2. wheels   install deepspeed, megatron-core and their missing needs from the carried .whl/
#               (fetched beforehand with benchmarks/fetch_gpu_wheels.sh; see benchmarks/gpu_wheels.py)
#   3. build    build ds_plugins._C with the CUDA kernels: COMMWEAVE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0
#   4. tests    pytest -m cuda: the dispatch/combine kernels and their backward against the reference
#               (fp32/bf16/fp16/fp64), and every other test marked cuda (WallFacer's block kernel,
#               Parm's layer on one GPU)
#   5. bench    python -m benchmarks.dispatch --device cuda: ours vs DeepSpeed's sparse path, megatron-core's
#               permute/unpermute and a device-to-device copy
#   6. packed   python -m benchmarks.packed_check --device cuda (block "WallFacer packed sequences" below): a
#               packed batch of documents through wallfacer_attention on one GPU (flash-attn's varlen path
#               when it imports, sdpa per document) against fp64 attention inside each document
#   7. calibrate  python -m megatron_patches.calibrate --ranks 1 --device cuda (block "WallFacer calibration"
#               below): the cost profile's kernel half on one GPU (bf16 attention per block size, forward and
#               backward, full and causal; a GEMM), written to $OUT/profile_gpu.json and read back
#   8. parm     python -m benchmarks.parm_gpu_check --device cuda (block "Parm checks" below): a bf16 ParmMoE
#               forward+backward and a no_grad "auto" forward against DeepSpeed's MoE; dispatch/combine with
#               hidden sizes 33 and 65, a storage-offset view and a non-default stream against the reference
#   9. bubbletea python -m benchmarks.bubbletea_gpu --device cuda (block "BubbleTea on one GPU" below): a
#               training loop with emulated bubbles (sleeps on a high-priority training stream) and BubbleTea's
#               prefill on the least-priority stream: training-step slowdown, prefill tokens/s, peak memory
# Each step prints PASS, FAIL or SKIP with its time; a failed step skips the ones that need it. The whole
# log, the pytest report, the benchmark's output and summary.json go to $OUT (the device tool sets it;
# default .gpu_check/). Exit status 0 only if every step passed. Warm-machine budget: under 7 minutes.
#
# From a session with the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# --dry-run (CI, no GPU): checks what the run needs without a GPU: the syntax of this script and of
# fetch_gpu_wheels.sh and csrc/nvcc_check.sh (shellcheck when installed), every tool the run calls, that
# setup.py still reads COMMWEAVE_CUDA, that the carried wheels (or, without .whl/, the local installs'
# metadata) resolve on the GPU image, that `pytest -m cuda` collects tests, and the benchmark end to end
# on a tiny CPU shape. (CI compiles the .cu files separately: csrc/nvcc_check.sh.)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo="$PWD"

out="${OUT:-$repo/.gpu_check}"
log="$out/gpu_check.log"
python="${PYTHON:-python3}"
site=/tmp/commweave_site
start=$SECONDS

say() { echo "$*" | tee -a "$log"; }

# step NAME LIMIT_S FUNCTION: run FUNCTION (below) under a time limit, in a child of this script so
# that `timeout` can stop it, with its output in the log; print and record the verdict.
step() {
    local name="$1" limit="$2" fn="$3" t0=$SECONDS rc
    echo -e "\n=== $name: $fn" >> "$log"
    timeout --kill-after=10 "$limit" bash "$repo/benchmarks/gpu_check.sh" --step "$fn" >> "$log" 2>&1
    rc=$?
    local took=$((SECONDS - t0))
    if [[ $rc -eq 0 ]]; then
        say "PASS $name (${took}s)"
        printf '%s\tPASS\t%s\t\n' "$name" "$took" >> "$steps"
    else
        local why="exit $rc"
        [[ $rc -eq 124 || $rc -eq 137 ]] && why="timed out after ${limit}s"
        local last
        last="$(tail -n 15 "$log" | sed 's/^/    /')"
        say "FAIL $name (${took}s): $why; last lines:"
        echo "$last"
        printf '%s\tFAIL\t%s\t%s\n' "$name" "$took" "$why" >> "$steps"
    fi
    return $rc
}

skip() {
    say "SKIP $1: $2"
    printf '%s\tSKIP\t0\t%s\n' "$1" "$2" >> "$steps"
}

# summary.json from the recorded steps and, where present, the benchmark's JSON line and pytest's report.
write_summary() {
    "$python" - "$steps" "$out" "$dry_run" "$((SECONDS - start))" <<'PY'
import json, pathlib, sys, xml.etree.ElementTree as ET
steps_file, out, dry_run, seconds = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
steps = [dict(zip(("name", "status", "seconds", "detail"), line.rstrip("\n").split("\t")))
         for line in open(steps_file) if line.strip()]
for s in steps:
    s["seconds"] = int(s["seconds"])
summary = {"dry_run": dry_run, "seconds": seconds, "steps": steps,
           "passed": all(s["status"] == "PASS" for s in steps if not (dry_run and s["status"] == "SKIP"))}
report = out / "pytest_cuda.xml"
if report.exists():
    suite = ET.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    summary["pytest"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = out / "bench.txt"
if bench.exists():
    lines = [l for l in bench.read_text().splitlines() if l.startswith("{")]
    if lines:
        summary["benchmark"] = json.loads(lines[-1])
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: summary[k] for k in summary if k != "steps"}))
PY
}

install_wheels() {
    rm -rf "$site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .whl/*.whl || return 1
    PYTHONPATH="$site:$repo" "$python" -c "
import deepspeed, megatron.core, torch
from deepspeed.moe.sharded_moe import _sparse_encode
from megatron.core.transformer.moe.moe_utils import permute
print('deepspeed', deepspeed.__version__, 'megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
}

gpu_info() {
    nvidia-smi -L || return 1
    "$python" -c "
import sys, torch
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
}

build_cuda() {
    rm -f ds_plugins/_C*.so
    COMMWEAVE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="${MAX_JOBS:-16}" "$python" setup.py build_ext --inplace \
        || return 1
    "$python" -c "
from ds_plugins import dispatch
assert dispatch.backend('cuda') == 'cuda', dispatch.backend('cuda')
print('ds_plugins._C with CUDA kernels: backend', dispatch.backend('cuda'))"
}

run_tests() {
    "$python" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$out/pytest_cuda.xml" tests
}

run_bench() {
    "$python" -m benchmarks.dispatch --device cuda --no-progress 2>&1 | tee "$out/bench.txt"
}

run_gpu() {
    say "commweave GPU check on $(uname -n), $(date -u +%FT%TZ), OUT=$out"
    step gpu 60 gpu_info || { skip wheels "no usable GPU"; skip build "no usable GPU"; skip tests "no usable GPU"
                              skip bench "no usable GPU"; skip wallfacer_blocks "no usable GPU"
                              skip wallfacer_packed "no usable GPU"; skip wallfacer_calibrate "no usable GPU"
                              skip parm "no usable GPU"; skip bubbletea "no usable GPU"; return; }
    step wallfacer_blocks 180 wallfacer_blocks
    step wallfacer_packed 180 wallfacer_packed
    step wallfacer_calibrate 180 wallfacer_calibrate
    step bubbletea 180 bubbletea_gpu
    local have_wheels=1
    if compgen -G ".whl/*.whl" > /dev/null; then
        step wheels 180 install_wheels || have_wheels=0
    else
        skip wheels "no .whl/*.whl carried (bash benchmarks/fetch_gpu_wheels.sh, then carry .whl)"
        have_wheels=0
    fi
    if [[ $have_wheels -eq 1 ]]; then
        export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if ! step build 300 build_cuda; then
        skip tests "the CUDA build failed"
        skip bench "the CUDA build failed"
        skip parm "the CUDA build failed"
        return
    fi
    step tests 300 run_tests
    if [[ $have_wheels -eq 1 ]]; then
        step bench 240 run_bench
    else
        skip bench "deepspeed and megatron-core are not installed (no wheels)"
    fi
    step parm 180 parm_checks
}

# --- dry run -------------------------------------------------------------------------------------------

lint_scripts() {
    local script
    for script in benchmarks/gpu_check.sh benchmarks/fetch_gpu_wheels.sh csrc/nvcc_check.sh; do
        bash -n "$script" || return 1
        if command -v shellcheck > /dev/null; then
            shellcheck "$script" || return 1
        fi
    done
    command -v shellcheck > /dev/null && echo "shellcheck: clean" || echo "shellcheck not installed: bash -n only"
}

tools_exist() {
    local tool missing=0
    for tool in "$python" bash timeout tee sed tail mktemp compgen uname date rm; do
        if ! command -v "$tool" > /dev/null; then
            echo "missing: $tool"
            missing=1
        fi
    done
    for tool in nvidia-smi nvcc; do
        command -v "$tool" > /dev/null || echo "$tool is not here (the GPU machine has it)"
    done
    "$python" -m pip --version && "$python" -m pytest --version && "$python" -c "import torch, setuptools" || missing=1
    "$python" -c "
import ast, pathlib, sys
tree = ast.parse(pathlib.Path('setup.py').read_text())
env = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
assert 'COMMWEAVE_CUDA' in env, 'setup.py no longer reads COMMWEAVE_CUDA'
print('setup.py parses and reads COMMWEAVE_CUDA')" || missing=1
    return $missing
}

check_wheels() {
    "$python" -m benchmarks.gpu_wheels --list > /dev/null || return 1
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$python" -m benchmarks.gpu_wheels --check .whl || return 1
        if python3.12 -c "" 2> /dev/null; then
            # pip's own verdict: every carried wheel installs on a CPython 3.12 (the GPU machine's).
            python3.12 -m pip install -q --dry-run --no-index --no-deps --ignore-installed \
                --target "$(mktemp -d)" .whl/*.whl && echo "python3.12 pip accepts the carried wheels"
        else
            echo "no working python3.12 here: pip's own check of the wheel tags skipped"
        fi
    else
        echo "no .whl/ here: checking the pinned set against the local installs' metadata"
        "$python" -m benchmarks.gpu_wheels --check
    fi
}

collect_cuda_tests() {
    local listing
    listing="$("$python" -m pytest -m cuda --collect-only -q -p no:cacheprovider tests 2>&1)" || {
        echo "$listing"
        return 1
    }
    echo "$listing" | tail -n 3
    echo "$listing" | grep -Eq '^[0-9]+/[0-9]+ tests collected|^[0-9]+ tests? collected' || {
        echo "pytest -m cuda selected no tests"
        return 1
    }
}

tiny_bench() {
    "$python" -m benchmarks.dispatch --device cpu --tokens 256 --model 64 --repeats 1 --warmup 0 --no-progress
}

run_dry() {
    say "commweave GPU check, dry run (no GPU needed), OUT=$out"
    step scripts 120 lint_scripts
    step tools 120 tools_exist
    step wheels 300 check_wheels
    step tests 300 collect_cuda_tests
    step bench 300 tiny_bench
    step wallfacer_blocks 300 wallfacer_blocks_dry
    step wallfacer_packed 300 wallfacer_packed_dry
    step wallfacer_calibrate 300 wallfacer_calibrate_dry
    step parm 300 parm_checks_cpu
    step bubbletea 300 bubbletea_gpu_dry
}

# --- WallFacer block kernels (issue 10, item 7) ------------------------------------------------------
# wallfacer_blocks: benchmarks/block_check.py on the GPU: WallFacer's block kernels (sdpa, flash-attn
# when it imports, the reference) forward + backward on strided inputs and a strided lse, against the fp64
# reference; needs only torch (no wheels, no build). Its CPU twin runs in tests/benchmarks/test_block_check.py;
# the dry run runs it on a CPU.
wallfacer_blocks() {
    "$python" -m benchmarks.block_check --device cuda 2>&1 | tee "$out/wallfacer_blocks.txt"
    return "${PIPESTATUS[0]}"
}

wallfacer_blocks_dry() {
    "$python" -m benchmarks.block_check --device cpu
}
# --- end of the WallFacer block ----------------------------------------------------------------------------

# --- WallFacer packed sequences (issue 21, item 6) ---------------------------------------------------------
# wallfacer_packed: benchmarks/packed_check.py on the GPU: one packed batch (THD, 9 documents of 1 … 700
# tokens, spans padded and not) through wallfacer_attention on one GPU — flash-attn's varlen functions, all
# documents in one call, when flash-attn imports; sdpa one call per document — forward + backward against
# fp64 attention inside each document (at most twice naive same-dtype attention's error), and its time
# against one dense causal call over the same tokens; needs only torch (no wheels, no build). Its CPU twin
# and the varlen path against a strict flash-attn stand-in run in tests/benchmarks/test_packed_check.py; the
# dry run runs the twin on the smaller, untimed batch of --quick.
wallfacer_packed() {
    "$python" -m benchmarks.packed_check --device cuda 2>&1 | tee "$out/wallfacer_packed.txt"
    return "${PIPESTATUS[0]}"
}

wallfacer_packed_dry() {
    "$python" -m benchmarks.packed_check --device cpu --quick
}
# --- end of the WallFacer packed sequences -----------------------------------------------------------------

# --- WallFacer calibration (issue 21, item 6) -------------------------------------------------------------
# wallfacer_calibrate: megatron_patches/calibrate.py with one rank on the GPU: the attention kernel's
# throughput per block size (512 .. 16384 rows, 8 heads x 128, bf16; forward with the online-softmax merge,
# backward with the accumulations; full and causal) and a 4096 x 4096 GEMM, into $OUT/profile_gpu.json
# (the links of one GPU are not measurable: the profile's provenance says they are the NVLink spec), then
# the profile is read back through profile.load and printed as one JSON line; needs only torch. The dry
# run does the same on the CPU with tiny blocks.
check_profile() {
    "$python" -c "
import json, sys
from megatron_patches.profile import load
p = load(sys.argv[1])
print(json.dumps({'benchmark': 'calibrate', 'device': p.provenance['device'], 'passed': True,
                  'fwd_tflops': p.attention['fwd'].points, 'bwd_tflops': p.attention['bwd'].points,
                  'gemm_tflops': p.gemm_tflops}))" "$1"
}

wallfacer_calibrate() {
    "$python" -m megatron_patches.calibrate --ranks 1 --device cuda --dtype bfloat16 --reps 5 --heads 8 \
        --head-dim 128 --hidden 4096 --rows 512 1024 2048 4096 8192 16384 --intra-GBps 450 \
        --out "$out/profile_gpu.json" > "$out/wallfacer_calibrate.txt" 2>&1 || { tail -n 20 "$out/wallfacer_calibrate.txt"; return 1; }
    check_profile "$out/profile_gpu.json"
}

wallfacer_calibrate_dry() {
    "$python" -m megatron_patches.calibrate --ranks 1 --device cpu --reps 1 --heads 1 --head-dim 16 \
        --hidden 64 --rows 32 64 --out "$out/profile_cpu.json" > /dev/null || return 1
    check_profile "$out/profile_cpu.json"
}
# --- end of the WallFacer calibration -----------------------------------------------------------------------

# --- Parm checks (issue 9 item 8) --------------------------------------------------------------------------
# The checks live in benchmarks/parm_gpu_check.py; without deepspeed (no wheels) its layer checks SKIP and
# the dispatch/combine checks still run. The dry run runs the same checks on the CPU.

parm_checks() {
    "$python" -m benchmarks.parm_gpu_check --device cuda --json "$out/parm_check.json"
}

parm_checks_cpu() {
    DS_ACCELERATOR=cpu "$python" -m benchmarks.parm_gpu_check --device cpu --json "$out/parm_check.json"
}
# --- end of the Parm checks ----------------------------------------------------------------------------------

# --- BubbleTea on one GPU (issue 20, item 1) ----------------------------------------------------------------
# bubbletea: benchmarks/bubbletea_gpu.py on the GPU: a training loop whose steps are matmuls then an emulated
# bubble (torch.cuda._sleep on the training stream, of the greatest priority), BubbleTea's PrefillServer on the
# device (runner "stream": a thread of the process, the least-priority stream) planned into each bubble;
# stock and prefill-on steps interleaved; prints the step slowdown, prefill tokens/s, the peak memory, the KV
# cap and peak, and the logits against the same chunks run alone. Needs only torch. The dry run runs its CPU
# twin (the null stream: the same server, service and window code).
bubbletea_gpu() {
    "$python" -m benchmarks.bubbletea_gpu --device cuda 2>&1 | tee "$out/bubbletea.txt"
    return "${PIPESTATUS[0]}"
}

bubbletea_gpu_dry() {
    "$python" -m benchmarks.bubbletea_gpu --device cpu --steps 8
}
# --- end of BubbleTea on one GPU -----------------------------------------------------------------------------

case "${1:-}" in
    --step)  # internal: one step's function, run by step() under its time limit
        "$2"
        exit $?
        ;;
    --dry-run) dry_run=1 ;;
    "") dry_run=0 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
mkdir -p "$out"
: > "$log"
steps="$(mktemp)"
trap 'rm -f "$steps"' EXIT
if [[ $dry_run -eq 1 ]]; then
    run_dry
else
    run_gpu
fi
say "total $((SECONDS - start))s"
write_summary | tee -a "$log"
"$python" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['passed'] else 1)" "$out/summary.json"
