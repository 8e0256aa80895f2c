"""Per-rank set-up: the exported plan, host lookup, RANK remap, per-DC interfaces, sysctl warnings,
Megatron's NCCL group config."""

import os
from pathlib import Path

import pytest

from launch import runtime, topology
from launch.estimate import ModelSpec
from launch.plan import make_plan

RAW = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": 2}], "ifname": "ens1"},
                       "b": {"hosts": [{"name": "b0", "slots": 2}], "ifname": "ens2"}},
       "wan": [{"between": ["a", "b"], "rtt_ms": 1000, "bandwidth_gbps": 10000}]}
MODEL = ModelSpec(layers=4, hidden=16, seq=8, global_batch=8, pp=2, tp=1, dp=2)


@pytest.fixture
def plan():
    return make_plan(topology.parse(RAW, source="t"), MODEL, connections=4, window=2**20)


@pytest.fixture
def env(monkeypatch):
    """runtime.init writes os.environ itself (GLOO_SOCKET_IFNAME, RANK, ...), which monkeypatch does not
    undo for variables that were absent: restore the whole environment, or later worlds inherit it."""
    saved = dict(os.environ)
    for k in ("ATLAS_PLAN", "ATLAS_HOST", "CROSS_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE",
              "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ATLAS_SHARING", "ATLAS_WAN_CONNS"):
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_current_plan_from_the_environment(env, plan):
    assert runtime.current_plan() is None
    env.setenv("ATLAS_PLAN", plan.encode())
    assert runtime.current_plan() == plan
    env.setenv("ATLAS_PLAN", "bm90IGEgcGxhbg==")
    with pytest.raises(ValueError, match="ATLAS_PLAN does not hold an ATLAS plan"):
        runtime.current_plan()


def test_rank_remap_by_host_name(env, plan):
    """A launcher that put b0 first gave b0's second process RANK 1; the plan says 3."""
    env.setenv("ATLAS_HOST", "b0")
    env.setenv("LOCAL_RANK", "1")
    env.setenv("RANK", "1")
    with pytest.warns(RuntimeWarning):
        runtime.init(plan)
    assert os.environ["RANK"] == "3" and plan.coord(3) == (1, 1, 0)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ens2" and os.environ["NCCL_SOCKET_IFNAME"] == "=ens2"


def test_deepspeed_node_index_keeps_rank_and_checks_it(env, plan):
    env.setenv("CROSS_RANK", "0")
    env.setenv("RANK", "1")
    env.setenv("GLOO_SOCKET_IFNAME", "mine")            # set by the user: kept
    with pytest.warns(RuntimeWarning):
        runtime.init(plan)
    assert os.environ["RANK"] == "1" and os.environ["GLOO_SOCKET_IFNAME"] == "mine"
    env.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"the plan gives that host ranks 0\.\.1"):
        runtime.init(plan)


@pytest.mark.parametrize("var, value, message", [
    ("WORLD_SIZE", "8", "WORLD_SIZE=8 but the ATLAS plan has 4 ranks"),
    ("ATLAS_HOST", "zz", "ATLAS_HOST='zz' is not a host of the plan"),
    ("CROSS_RANK", "5", "CROSS_RANK=5: the plan has 2 hosts"),
])
def test_init_refuses_inconsistent_environments(env, plan, var, value, message):
    env.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        runtime.init(plan)


def test_init_warns_with_the_sysctl_name(env, plan):
    env.setenv("CROSS_RANK", "0")
    with pytest.warns(RuntimeWarning, match=r"ATLAS: net\.ipv4\.tcp_rmem max is \d+ bytes"):
        runtime.init(plan)                           # 10 Tb/s x 1 s: no host has that buffer


def test_settings_and_megatron_config(env, plan, tmp_path):
    with pytest.raises(ValueError, match="no ATLAS plan"):
        runtime.enable_megatron()
    env.setenv("ATLAS_SHARING", "fair")
    with pytest.raises(ValueError, match="ATLAS_SHARING='fair'"):
        runtime.enable_megatron(plan)
    path = runtime.megatron_nccl_config(plan, directory=str(tmp_path))
    assert Path(path).read_text().startswith("pp:\n  net_name: socket\n")
    one_dc = make_plan(topology.parse(RAW, source="t"), ModelSpec(layers=4, hidden=16, seq=8, global_batch=8,
                                                                  pp=1, tp=1, dp=2), 4, window=2**20)
    assert runtime.megatron_nccl_config(one_dc) is None
