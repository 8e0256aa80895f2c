"""Repository invariants: CI runs the README's test command verbatim, and the tree is lint-clean."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    """The indented command lines of the README's first section (before the first '## ')."""
    head = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    return [line.strip() for line in head.splitlines() if line.startswith("    ") and line.strip()]


def test_ci_runs_the_readme_test_command_verbatim():
    commands = _readme_commands()
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, f"the README must start with exactly one test command, found {tests}"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in [line.strip() for line in ci], ".ci/run must run the README's test command verbatim"


def test_readme_test_command_installs_what_it_needs():
    (cmd,) = [c for c in _readme_commands() if "pytest" in c]
    assert re.search(r"pip install .*torch==2\.13\.0", cmd)
    assert "--no-build-isolation" in cmd and "[test]" in cmd


@pytest.mark.skipif(shutil.which("ruff") is None and
                    not (pathlib.Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is not installed (pip install '.[test]' brings it)")
def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
