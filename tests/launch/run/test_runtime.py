"""Per-rank set-up: the exported plan, host lookup, RANK remap, per-DC interfaces, sysctl warnings,
Megatron's NCCL group config."""

import os
import re
from pathlib import Path

import pytest

from launch.plan import topology
from launch.plan.estimate import ModelSpec
from launch.plan.placement import make_plan
from launch.run import runtime

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
    for k in ("ATLAS_PLAN", "ATLAS_HOST", "CROSS_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "ATLAS_LAUNCHER",
              "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ATLAS_SHARING", "ATLAS_WAN_CONNS", "MASTER_ADDR",
              "MASTER_PORT", "SLURMD_NODENAME", *runtime._LOCAL_VARS, *runtime._MPI_RANK_VARS,
              *runtime._WORLD_VARS, "SLURM_PROCID"):
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
    env.setenv("GLOO_SOCKET_IFNAME", "mine")            # a default exported to every node: the DC's wins
    env.setenv("NCCL_SOCKET_IFNAME", "^docker")
    with pytest.warns(RuntimeWarning):
        runtime.init(plan)
    assert os.environ["RANK"] == "1" and os.environ["LOCAL_RANK"] == "1"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ens1" and os.environ["NCCL_SOCKET_IFNAME"] == "=ens1"
    env.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"the plan gives that host ranks 0\.\.1"):
        runtime.init(plan)


@pytest.mark.parametrize("launcher, variables, rank, local", [
    # DeepSpeed's launch (pdsh, --no_ssh, one node): node index and rank kept, checked
    ("pdsh", {"CROSS_RANK": "1", "RANK": "3", "LOCAL_RANK": "1"}, 3, 1),
    # OpenMPI keeps the hostfile order: its world rank is the plan's, its local rank must agree
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                 "OMPI_COMM_WORLD_SIZE": "4"}, 2, 0),
    # Slurm orders nodes its own way: the plan's rank from the node name and SLURM_LOCALID
    ("slurm", {"SLURMD_NODENAME": "b0", "SLURM_LOCALID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "4"},
     3, 1),
    # DeepSpeed's launcher_helper (mpich) and impi's -env set RANK/LOCAL_RANK; PMI_RANK places the host
    ("mpich", {"PMI_RANK": "1", "RANK": "1", "LOCAL_RANK": "1", "PMI_SIZE": "4"}, 1, 1),
    ("impi", {"PMI_RANK": "3", "RANK": "3", "LOCAL_RANK": "1"}, 3, 1),
])
def test_each_launcher_places_the_rank(env, plan, launcher, variables, rank, local):
    env.setenv("ATLAS_LAUNCHER", launcher)
    env.setenv("ATLAS_MASTER_ADDR", "10.0.0.9")
    env.setenv("ATLAS_MASTER_PORT", "29501")
    for k, v in variables.items():
        env.setenv(k, v)
    with pytest.warns(RuntimeWarning):
        runtime.init(plan)
    placed = (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"])
    assert placed == (str(rank), str(local), "4")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "29501")


@pytest.mark.parametrize("launcher, variables, message", [
    ("slurm", {"SLURMD_NODENAME": "b0"}, "no local rank for this process on b0, which runs 2 ranks: none of "
                                         "SLURM_LOCALID, LOCAL_RANK is set (launcher slurm); ATLAS does not "
                                         "assume local rank 0"),
    (None, {"ATLAS_HOST": "a0"}, "none of LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID"),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     "rank 1 is local rank 0 on a0, but the plan puts it at local index 1"),
    ("slurm", {"SLURMD_NODENAME": "node7", "SLURM_LOCALID": "0"}, "SLURMD_NODENAME='node7'"),
    ("openmpi", {"OMPI_COMM_WORLD_SIZE": "8"}, "OMPI_COMM_WORLD_SIZE=8 but the ATLAS plan has 4 ranks"),
    ("slurm", {"SLURMD_NODENAME": "a0", "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x': must be an integer"),
    ("torchrun", {}, "ATLAS_LAUNCHER='torchrun': not a launcher ATLAS adapts"),
])
def test_no_silent_local_rank_zero(env, plan, launcher, variables, message):
    if launcher:
        env.setenv("ATLAS_LAUNCHER", launcher)
    for k, v in variables.items():
        env.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape(message)):
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
    env.setenv("LOCAL_RANK", "0")
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


def test_megatron_config_names_every_group_that_crosses_the_wan(env, plan, tmp_path):
    """With pipe outermost, Megatron's pp, mp (tp x pp), embedding and tp_ep_pp groups span stages, hence
    data centers: each gets net_name socket under the name megatron-core 0.16.1 looks it up by."""
    import inspect

    from megatron.core import parallel_state

    text = Path(runtime.megatron_nccl_config(plan, directory=str(tmp_path))).read_text()
    config = {group: {"net_name": net} for group, net in re.findall(r"(\w+):\n  net_name: (\w+)\n", text)}
    assert text == "".join(f"{g}:\n  net_name: socket\n" for g in config)    # the whole file, as YAML
    assert config == {g: {"net_name": "socket"} for g in ("pp", "mp", "embd", "pos_embd", "tp_ep_pp")}
    source = inspect.getsource(parallel_state.initialize_model_parallel)
    for name in config:
        assert f'get_nccl_options("{name}", nccl_comm_cfgs)' in source, name


def test_tcp_advice_counts_every_flow_of_a_boundary_transfer():
    """With tp > 1 each of the stage's tp ranks sends its slice over k connections: the buffer advice is
    for tp·k flows on the link, as the planner's CLI prints it."""
    from launch.plan.socket_limits import WINDOW_FRACTION, tcp_advice
    from launch.plan.topology import WanLink

    model = ModelSpec(layers=4, hidden=16, seq=8, global_batch=8, pp=2, tp=2, dp=1)
    tp2 = make_plan(topology.parse(RAW, source="t"), model, connections=4, window=2**20)
    assert (tp2.tp, tp2.connections, tp2.wan_flows) == (2, 4, 8)
    sysctls = {"net.ipv4.tcp_rmem": "4096 131072 1024", "net.ipv4.tcp_wmem": "4096 16384 1024"}
    links = [WanLink(*w) for w in tp2.wan_links]
    assert runtime._advice(tp2) == tcp_advice(links, 8) != tcp_advice(links, 4)
    need = [int(line.split(" need ")[1].split()[0]) for line in tcp_advice(links, 8, read=sysctls.get)]
    assert need and all(n == int(links[0].bdp / 8 / WINDOW_FRACTION) for n in need)
