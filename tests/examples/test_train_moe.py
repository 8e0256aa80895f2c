"""The README's main job: examples/train_moe.py under the deepspeed launcher on 4 CPU ranks (TP 2 x EP 2),
with Parm switched on by configs/parm_cpu.json. Smaller sizes than the README's run, same code path:
the launcher, ds_plugins.initialize swapping DeepSpeed's MoE, the "auto" selector, ZeRO-1 steps, and an eval
pass (engine.eval(), torch.no_grad()) every few steps."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_main_job_trains_with_parm():
    launcher = Path(sys.executable).parent / "deepspeed"
    if not launcher.exists():
        pytest.skip(f"the deepspeed launcher is not installed next to {sys.executable}")
    cmd = [str(launcher), "--num_gpus", "4", "--master_port", str(_free_port()), "examples/train_moe.py",
           "--deepspeed_config", "configs/parm_cpu.json", "--ffn", "512", "--layers", "1", "--steps", "5"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"step\s+\d+\s+loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 5, log[-4000:]
    assert losses[-1] < 0.5 * losses[0], losses  # a fixed next-token map is learnt within a few steps
    evals = [float(x) for x in re.findall(r"step\s+\d+\s+eval loss ([0-9.]+)", out.stdout)]
    assert len(evals) == 1 and evals[0] < 0.5 * losses[0], (evals, losses)  # step 4, on held-out tokens
    ran = re.search(r"parm schedule 'auto': MoE layers ran \[(.*)\]", out.stdout)
    # swapped in, and auto chose one of Parm's schedules: the deepspeed order, S1 or S2
    assert ran and ran.group(1) in ("'deepspeed'", "'s1'", "'s2'"), log[-2000:]


def test_gpu_command_config_loads():
    """The GPU command of examples/train_moe.py's docstring names configs/parm_gpu.json: DeepSpeed and Parm
    parse it (it runs on GPUs only: bf16 and FusedAdam)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_plugins import ParmConfig

    doc = (ROOT / "examples" / "train_moe.py").read_text()
    assert "--deepspeed_config configs/parm_gpu.json" in doc
    config = DeepSpeedConfig(str(ROOT / "configs" / "parm_gpu.json"))
    assert config.bfloat16_config.enabled and config.zero_optimization_stage == 1
    assert ParmConfig.from_deepspeed(str(ROOT / "configs" / "parm_gpu.json")).enabled
