"""benchmarks/gpu_check.sh stays runnable without a GPU (its --dry-run), and benchmarks/gpu_wheels.py
catches a wheel set that would not install on the GPU machine."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_wheels

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_passes(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] and summary["passed"]
    names = [s["name"] for s in summary["steps"]]
    assert names == ["scripts", "tools", "wheels", "tests", "bench", "wallfacer_blocks", "wallfacer_packed",
                     "wallfacer_calibrate", "parm", "bubbletea"], names
    assert all(s["status"] == "PASS" for s in summary["steps"]), summary["steps"]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "tests collected" in log and '"benchmark": "dispatch"' in log
    assert '"benchmark": "block_check", "device": "cpu", "passed": true' in log
    assert '"benchmark": "packed_check", "device": "cpu", "passed": true, "cases": 6' in log
    assert '"benchmark": "calibrate", "device": "cpu", "passed": true' in log
    assert "PASS parm dispatch-combine on cpu" in log and "PASS parm bf16-layer on cpu" in log
    assert '"benchmark": "bubbletea_gpu", "device": "cpu"' in log and '"max_diff_alone": 0.0' in log


def test_usage_error():
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--bogus"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


def _wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any") -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-{tag}.whl", "w") as z:
        lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        z.writestr(f"{dist}.dist-info/METADATA", "Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")


def _pinned_set(folder: Path) -> None:
    for name, version in gpu_wheels.WHEELS.items():
        _wheel(folder, name, version)


def test_wheel_check_accepts_the_pinned_set(tmp_path):
    _pinned_set(tmp_path)
    assert gpu_wheels.check(tmp_path) == ([], [])


@pytest.mark.parametrize("fault", ["missing", "two versions", "wrong tag", "unmet need", "version clash",
                                   "image too old", "unpinned"])
def test_wheel_check_reports(tmp_path, fault):
    _pinned_set(tmp_path)
    expected = {
        "missing": "hjson==3.1.0 is not in",
        "two versions": "two wheels of hjson",
        "wrong tag": "no tag installs on CPython 3.12",
        "unmet need": "needs left-pad: neither carried nor on the image",
        "version clash": "needs pydantic-core==9.9, the carried pydantic-core is 2.50.5",
        "image too old": "needs torch>=3.0, the image has torch 2.11.0",
        "unpinned": "left-pad in",
    }[fault]
    if fault == "missing":
        (tmp_path / "hjson-3.1.0-py3-none-any.whl").unlink()
    elif fault == "two versions":
        _wheel(tmp_path, "hjson", "3.0.0")
    elif fault == "wrong tag":
        (tmp_path / "hjson-3.1.0-py3-none-any.whl").unlink()
        _wheel(tmp_path, "hjson", "3.1.0", tag="cp310-cp310-win_amd64")
    elif fault in ("unmet need", "version clash", "image too old"):
        need = {"unmet need": "left-pad", "version clash": "pydantic-core==9.9",
                "image too old": "torch>=3.0"}[fault]
        (tmp_path / "hjson-3.1.0-py3-none-any.whl").unlink()
        _wheel(tmp_path, "hjson", "3.1.0", requires=[need, "jax; extra == 'tpu'"])
    else:
        _wheel(tmp_path, "left-pad", "1.0")
    problems, _ = gpu_wheels.check(tmp_path)
    assert any(expected in p for p in problems), problems


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_are_shellcheck_clean():
    for script in ("benchmarks/gpu_check.sh", "benchmarks/fetch_gpu_wheels.sh", "csrc/nvcc_check.sh"):
        subprocess.run(["shellcheck", script], cwd=REPO, check=True, timeout=60)
