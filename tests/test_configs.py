"""Every file in configs/ is real and exercised: it loads with the parser that consumes it (DeepSpeed's own
config class and Parm's section for DeepSpeed JSON, the ATLAS topology loader for topologies), and it is
named by a test (which runs it) or is the default config of the main job (which a test runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").iterdir())


def _kind(path: Path) -> str:
    if path.suffix != ".json":
        return "other"
    data = json.loads(path.read_text())
    if "datacenters" in data:
        return "topology"
    if {"train_micro_batch_size_per_gpu", "train_batch_size"} & set(data):
        return "deepspeed"
    return "other"


def _tests_text() -> str:
    me = Path(__file__).resolve()
    return "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.resolve() != me)


def test_every_config_is_known_and_named_by_a_test():
    text = _tests_text()
    job = (ROOT / "examples" / "train_gpt.py").read_text()   # its default configs run in test_train_gpt
    assert CONFIGS, "configs/ is empty"
    for path in CONFIGS:
        assert _kind(path) != "other", f"{path.name}: neither a DeepSpeed config nor an ATLAS topology"
        assert path.name in text or f'"{path.name}"' in job, f"configs/{path.name} is exercised by no test"


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "deepspeed"], ids=lambda p: p.name)
def test_deepspeed_configs_load(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_plugins import ParmConfig

    config = DeepSpeedConfig(str(path))
    assert config.zero_optimization_stage in (0, 1, 2)
    parm = ParmConfig.from_deepspeed(str(path))
    assert parm.enabled


@pytest.mark.parametrize("name", ["gpt_cpu.json", "gpt_gpu.json"])
def test_main_job_configs_pass_its_checks(name):
    from examples.train_gpt import load_config

    on, off = load_config(str(ROOT / "configs" / name), 8)
    assert on["parm"]["enabled"] and not off["parm"]["enabled"]
    assert on["train_micro_batch_size_per_gpu"] == 8 and {**on, "parm": None} == {**off, "parm": None}


@pytest.mark.parametrize("path", [p for p in CONFIGS if _kind(p) == "topology"], ids=lambda p: p.name)
def test_topologies_load(path):
    from launch.plan import topology

    topo = topology.load(str(path))
    assert topo.datacenters
