"""deepspeed-atlas: argument handling and errors before launch (the command line itself, once, as a
user runs it). Every launcher path with stand-in tools: tests/launch/run/test_launchers.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.plan.plan import Plan
from launch.run.launchers import shell_export
from launch.run.runner import prepare

REPO = Path(__file__).resolve().parents[3]
SCRIPT = "tests/launch/dump_env.py"
NASTY = "it's $(touch {mark}) `touch {mark}` \"q\" $HOME; touch {mark} \\"


def _topology(tmp_path, hosts_a=1, hosts_b=1, slots=1, model=None, **wan):
    raw = {"datacenters": {
        "a": {"hosts": [{"name": f"a{i}", "slots": slots, "addr": "127.0.0.1"} for i in range(hosts_a)],
              "ifname": "lo"},
        "b": {"hosts": [{"name": f"b{i}", "slots": slots} for i in range(hosts_b)], "ifname": "lo"}},
        "wan": [{"between": ["a", "b"], "rtt_ms": 40, "bandwidth_gbps": 10, **wan}],
        "model": model or {"layers": 4, "hidden": 64, "seq": 32, "global_batch": 4,
                           "pp": 2, "tp": 1, "dp": 1}}
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_arguments_pass_through(tmp_path):
    topo = _topology(tmp_path)
    launch = prepare(["--master_port", "29123", "--atlas-topology", topo, "--wan-connections=3",
                      "--no_local_rank", SCRIPT, "--wan-connections", "9", "--atlas-topology", "x"])
    assert launch.argv == ["--master_port", "29123", "--no_local_rank", "--master_addr", "127.0.0.1",
                           "--hostfile", "", SCRIPT, "--wan-connections", "9", "--atlas-topology", "x"]
    assert launch.env["ATLAS_WAN_CONNS"] == "3" and launch.env["NCCL_NSOCKS_PERTHREAD"] == "3"
    assert Plan.decode(launch.env["ATLAS_PLAN"]) == launch.plan
    assert launch.plan.hostfile() == "a0 slots=1\nb0 slots=1\n"


def test_the_launch_uses_the_planners_choices(tmp_path):
    """Without --wan-connections / --atlas-sharing the job runs with what the planner chose (spatial
    sharing unless asked)."""
    from launch.plan.placement import load_model, make_plan
    from launch.plan.topology import load

    topo = _topology(tmp_path)
    launch = prepare(["--atlas-topology", topo, SCRIPT])
    t = load(topo)
    want = make_plan(t, load_model(t, None))
    assert launch.plan == want
    assert launch.env["ATLAS_WAN_CONNS"] == str(want.connections)
    assert launch.env["ATLAS_SHARING"] == want.sharing == "spatial"    # temporal: only when asked
    asked = prepare(["--atlas-topology", topo, "--atlas-sharing", "temporal", SCRIPT])
    assert asked.env["ATLAS_SHARING"] == asked.plan.sharing == "temporal"
    assert launch.env["NCCL_NSOCKS_PERTHREAD"] == str(min(want.connections, 8))


def test_no_ssh_finds_this_node(tmp_path):
    topo = _topology(tmp_path)
    by_index = prepare(["--atlas-topology", topo, "--no_ssh", "--node_rank", "1", SCRIPT])
    assert by_index.node == "b0" and by_index.argv[by_index.argv.index("--node_rank") + 1] == "1"
    assert by_index.env["GLOO_SOCKET_IFNAME"] == os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    by_name = prepare(["--atlas-topology", topo, "--no_ssh", "--atlas-host", "a0", SCRIPT])
    assert by_name.argv.count("--node_rank") == 1 and "0" in by_name.argv
    big = _topology(tmp_path, hosts_b=2)          # pp=2 x 1 GPU fits in b, the larger DC: a0 idles
    assert prepare(["--atlas-topology", big, "--no_ssh", "--atlas-host", "a0", SCRIPT]).idle


@pytest.mark.parametrize("extra, env, message", [
    (["--atlas-host", "zz"], {}, "unknown host 'zz'"),
    (["--node_rank", "2"], {}, "--node_rank 2: the plan uses 2 hosts"),
    (["--atlas-host", "a0", "--node_rank", "1"], {}, "disagree"),
    ([], {"NCCL_SOCKET_NTHREADS": "16"}, "8 x 16 = 128: must be <= 64"),
])
def test_bad_no_ssh_and_nccl_settings(tmp_path, monkeypatch, extra, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        prepare(["--atlas-topology", _topology(tmp_path), "--wan-connections", "8", "--no_ssh", *extra,
                 SCRIPT])


def _run(args, env=None, cwd=REPO, timeout=120):
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout)


def _broken_topology(tmp_path, mutate):
    raw = json.loads(Path(_topology(tmp_path)).read_text())
    mutate(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_a_bad_topology_stops_before_anything_launches(tmp_path):
    path = _broken_topology(tmp_path, lambda r: r["wan"][0].update(between=["a", "c"]))
    out = tmp_path / "out"
    res = _run(["--atlas-topology", path, SCRIPT, "--out", str(out)])
    assert res.returncode == 2 and "unknown data center 'c'" in res.stderr, res.stderr
    assert not out.exists()                                      # the script never ran


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["wan"][0].update(between=["a", "c"]), "unknown data center 'c'"),
    (lambda r: r.update(wan=[]), "no WAN entry between 'a' and 'b'"),
    (lambda r: r["model"].update(pp=2, tp=1, dp=4), "too few GPUs for the plan"),
])
def test_bad_topologies_raise_in_prepare(tmp_path, mutate, message):
    with pytest.raises(ValueError, match=message):
        prepare(["--atlas-topology", _broken_topology(tmp_path, mutate), SCRIPT])


@pytest.mark.parametrize("argv, message", [
    (["--hostfile", "/etc/hosts"], "--hostfile '/etc/hosts': Hostfile contains a bad entry"),
    (["--include", "a0"], "too few GPUs for the plan"),    # a0's one GPU cannot hold two stages
    (["--num_gpus", "2"], "--num_gpus 2: more than these hosts offer"),
    (["--wan-connections", "65"], "must be <= 64"),
    (["--atlas-sharing", "fair"], r"--atlas-sharing='fair': must be one of \('spatial', 'temporal'"),
])
def test_conflicting_arguments(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        prepare(["--atlas-topology", _topology(tmp_path), *argv, SCRIPT])


def test_shell_export_runs_nothing(tmp_path):
    mark = tmp_path / "mark"
    value = NASTY.format(mark=mark) + "\nsecond line"
    name, quoted = shell_export("ATLAS_X", value)
    out = subprocess.run(["sh", "-c", f'export {name}={quoted}; printf %s "$ATLAS_X"'], capture_output=True,
                         text=True, check=True).stdout
    assert out == value.strip() and not mark.exists()
    with pytest.raises(ValueError, match="cannot be exported"):
        shell_export("NCCL_X;touch", "1")
