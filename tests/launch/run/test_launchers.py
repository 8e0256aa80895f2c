"""deepspeed-atlas through every launcher path it supports (pdsh with DeepSpeed's ssh check, --no_ssh,
openmpi, slurm, mpich, impi), with stand-in tools on PATH (tests/launch/fakes.py) that record their argv
and do with it what the real tool does, shell included where the real tool uses one:

- hostile values in the topology file, in arguments and in the environment are refused before any
  tool runs (no call recorded, the marker file never created);
- hostile values the user means literally (script arguments, exported variables) reach every rank
  verbatim, and nothing in them runs;
- every rank gets its plan rank and its local rank from the launcher's own variables (never a silent
  local rank 0), its data center's interface, the master address and the timeout;
- ``--dry-run`` prints the per-node commands and launches nothing; ``--include``/``--exclude`` select
  hosts and slots before the plan is made; mvapich is refused with the reason.

``runner.main`` runs in this process (DeepSpeed imported once); the ranks run tests/launch/dump_env.py.
"""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from commweave.world import free_port
from launch.run.runner import main, prepare
from tests.launch import fakes
from tests.launch.hostile import HOSTILE, hostile, ran

REPO = Path(__file__).resolve().parents[3]
SCRIPT = str(REPO / "tests" / "launch" / "dump_env.py")
# One value carrying every hazard at once: it must arrive as it is on every rank.
LITERAL = "it's $(touch {mark}) `touch {mark}` \"q\" $HOME;\ntouch {mark} # a,b=c ä \\"

PATHS = {   # launcher path -> arguments selecting it (the ssh check runs on the pdsh path)
    "pdsh": [],
    "no_ssh": ["--no_ssh", "--node_rank", "0"],
    "openmpi": ["--launcher", "openmpi"],
    "slurm": ["--launcher", "slurm"],
    "mpich": ["--launcher", "mpich"],
    "impi": ["--launcher", "impi"],
}


def _topology(tmp_path, slots=1, addr="127.0.0.1", name="topology.json", **edits):
    raw = {"datacenters": {
        "a": {"hosts": [{"name": "a0", "slots": slots, "addr": addr}], "ifname": "lo"},
        "b": {"hosts": [{"name": "b0", "slots": slots}], "ifname": "lo"}},
        "wan": [{"between": ["a", "b"], "rtt_ms": 1, "bandwidth_gbps": 1}],
        "model": {"layers": 4, "hidden": 64, "seq": 32, "global_batch": 4 * slots,
                  "pp": 2, "tp": 1, "dp": slots}}
    for edit in edits.values():
        edit(raw)
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """The stand-in tools first on PATH; the process environment and signal handlers restored after
    (runner.main writes os.environ and installs SIGINT/SIGTERM handlers on the pdsh path)."""
    bin_dir = fakes.install(tmp_path)
    saved_env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "COMMWEAVE_TIMEOUT_S"):
        monkeypatch.delenv(var, raising=False)
    yield bin_dir
    os.environ.clear()
    os.environ.update(saved_env)
    for s, h in handlers.items():
        signal.signal(s, h)


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _ranks(out: Path) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


# -- refused before anything runs ---------------------------------------------------------------------

TOPOLOGY_FIELDS = {
    "host name": lambda v: lambda r: r["datacenters"]["b"]["hosts"][0].update(name=v),
    "addr": lambda v: lambda r: r["datacenters"]["a"]["hosts"][0].update(addr=v),
    "ifname": lambda v: lambda r: r["datacenters"]["b"].update(ifname=v),
    "dc name": lambda v: lambda r: (r["datacenters"].update({v: r["datacenters"].pop("b")}),
                                    r["wan"][0].update(between=["a", v])),
}


@pytest.mark.parametrize("field", list(TOPOLOGY_FIELDS))
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_topology_values_run_nothing_on_any_path(tools, tmp_path, capsys, field, kind):
    mark = tmp_path / "mark"
    value = hostile(kind, mark)
    topo = _topology(tmp_path, bad=TOPOLOGY_FIELDS[field](value))
    for path, extra in PATHS.items():
        code, _, err = _run(["--atlas-topology", topo, *extra, SCRIPT, "--out", str(tmp_path / "out")],
                            capsys)
        assert code == 2 and repr(value) in err and topo in err, (path, err)
    assert fakes.calls(tools) == [] and not ran(mark) and not (tmp_path / "out").exists()


ARGUMENTS = {   # argument -> the rule its error states
    "--master_addr": "must be a host name or an IP address",
    "--atlas-host": "must be an RFC 1123 host name",
}


@pytest.mark.parametrize("option", list(ARGUMENTS))
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_arguments_run_nothing(tools, tmp_path, capsys, option, kind):
    mark = tmp_path / "mark"
    value = hostile(kind, mark)
    topo = _topology(tmp_path)
    for path, extra in PATHS.items():
        code, _, err = _run(["--atlas-topology", topo, *extra, option, value, SCRIPT, "--out", "x"], capsys)
        assert code == 2 and f"{option}={value!r}: {ARGUMENTS[option]}" in err, (path, err)
    assert fakes.calls(tools) == [] and not ran(mark)


ENVIRONMENT = {   # variable -> the rule its error states
    "GLOO_SOCKET_IFNAME": "must be a Linux interface name",
    "NCCL_SOCKET_IFNAME": "must be interface names or prefixes",
    "COMMWEAVE_TIMEOUT_S": "the timeout must be a finite number of seconds in [1, 604800]",
    "ATLAS_HOST": "must be an RFC 1123 host name",
}


@pytest.mark.parametrize("var", list(ENVIRONMENT))
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_environment_runs_nothing(tools, tmp_path, capsys, monkeypatch, var, kind):
    if kind == "comma" and var.endswith("_IFNAME"):
        pytest.skip("a comma separates the entries of an interface list: 'a0,evil' is two valid names")
    mark = tmp_path / "mark"
    value = hostile(kind, mark)
    monkeypatch.setenv(var, value)
    topo = _topology(tmp_path)
    for path, extra in PATHS.items():
        code, _, err = _run(["--atlas-topology", topo, *extra, SCRIPT, "--out", "x"], capsys)
        assert code == 2 and var in err and ENVIRONMENT[var] in err, (path, err)
    assert fakes.calls(tools) == [] and not ran(mark)


@pytest.mark.parametrize("argv, env, message", [
    (["--master_port", "0"], {}, "--master_port=0: must be an integer in [1, 65535] (TCP port)"),
    (["--master_port", "65536"], {}, "--master_port=65536: must be an integer in [1, 65535]"),
    (["--ssh_port", "70000"], {}, "--ssh_port=70000: must be an integer in [1, 65535]"),
    (["--atlas-timeout", "nan"], {}, "--atlas-timeout='nan': the timeout must be a finite number of seconds"),
    (["--launcher", "mvapich"], {}, "--launcher mvapich: DeepSpeed's mvapich runner needs MVAPICH2-GDR"),
    ([], {"ATLAS_X;touch": "1"}, "'ATLAS_X;touch' cannot be exported to the nodes"),
])
def test_bad_arguments_and_names(tools, tmp_path, capsys, monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, _, err = _run(["--atlas-topology", _topology(tmp_path), *argv, SCRIPT], capsys)
    assert code == 2 and message in err, err
    assert fakes.calls(tools) == []


def test_launcher_requirements(tmp_path):
    uneven = _topology(tmp_path, name="uneven.json",          # stages b, b, a: 2 ranks on b0, 1 on a0
                       b=lambda r: (r["datacenters"]["b"]["hosts"][0].update(slots=2),
                                    r["model"].update(pp=3)))
    with pytest.raises(ValueError, match=r"--launcher slurm: it starts the same number of ranks on every "
                                         r"host, but the plan uses \{'b0': 2, 'a0': 1\}"):
        prepare(["--atlas-topology", uneven, "--launcher", "slurm", SCRIPT], environ={})
    no_addr = _topology(tmp_path, addr=None, name="no_addr.json",
                        x=lambda r: r["datacenters"]["a"]["hosts"][0].pop("addr"))
    with pytest.raises(ValueError, match=r"--launcher openmpi: the ranks need MASTER_ADDR"):
        prepare(["--atlas-topology", no_addr, "--launcher", "openmpi", SCRIPT], environ={})
    env_file = tmp_path / "envfile"
    env_file.write_text("ATLAS_OK=1\n\n")
    with pytest.raises(ValueError, match=r"line 2 '\\n' is not KEY=VALUE"):
        from unittest import mock

        from deepspeed.launcher import runner
        with mock.patch.object(runner, "DEEPSPEED_ENVIRONMENT_PATHS", [str(tmp_path)]), \
                mock.patch.object(runner, "DEEPSPEED_ENVIRONMENT_NAME", "envfile"):
            prepare(["--atlas-topology", _topology(tmp_path), SCRIPT], environ={})


# -- what the user means literally reaches every rank verbatim -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_values_arrive_verbatim_and_ranks_are_placed(tools, tmp_path, capsys, monkeypatch, path):
    mark = tmp_path / "mark"
    literal = LITERAL.format(mark=mark)
    user_args = [hostile(kind, mark) for kind in HOSTILE] + [literal]
    monkeypatch.setenv("ATLAS_TEST_VALUE", literal)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")             # a global default: each DC's lo wins
    monkeypatch.setenv("COMMWEAVE_TIMEOUT_S", "42")
    # mpich starts DeepSpeed's launcher_helper (a deepspeed import) per rank: one rank per host keeps
    # it cheap; its local rank from MPI_LOCALRANKID on a 2-slot host: test_runtime.py
    slots = 1 if path == "mpich" else 2
    out = tmp_path / "out"
    port = str(free_port())
    code, stdout, err = _run(["--atlas-topology", _topology(tmp_path, slots=slots), "--wan-connections", "3",
                              *PATHS[path], "--master_port", port, SCRIPT, "--out", str(out), "--",
                              *user_args], capsys)
    assert code == 0, stdout + err
    ranks = _ranks(out)
    expect = [0, 1] if path == "no_ssh" else list(range(2 * slots))   # --no_ssh: this node only
    assert sorted(ranks) == expect, (stdout, err)
    for rank, r in ranks.items():
        assert r["rest"] == user_args                                # arguments: verbatim, one word each
        assert r["env"]["ATLAS_TEST_VALUE"] == literal.strip()       # exported value: verbatim
        assert r["env"]["ATLAS_LAUNCHER"] == ("pdsh" if path == "no_ssh" else path)
        assert r["env"]["COMMWEAVE_TIMEOUT_S"] == "42"
        assert (r["host"], r["local_rank"]) == (("a0", "b0")[rank // slots], str(rank % slots))
        assert r["world_size"] == str(2 * slots) and r["master"] == ["127.0.0.1", port]
        assert r["gloo_ifname"] == "lo"                              # the data center's interface
    assert not ran(mark)
    tools_called = [c["tool"] for c in fakes.calls(tools)]
    tool = {"pdsh": "pdsh", "openmpi": "mpirun", "slurm": "srun", "mpich": "mpirun", "impi": "mpirun"}
    assert tools_called == ([] if path == "no_ssh" else ["ssh", tool[path]])
    if path != "no_ssh":   # DeepSpeed's ssh check ran against the first host of the plan, as one word
        assert fakes.calls(tools)[0]["argv"] == ["-o", "PasswordAuthentication=no", "a0", "hostname"]


# -- dry run, --include/--exclude ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["pdsh", "no_ssh", "openmpi", "slurm"])
def test_dry_run_prints_every_node_and_launches_nothing(tools, tmp_path, capsys, path):
    out = tmp_path / "out"
    code, stdout, err = _run(["--atlas-topology", _topology(tmp_path, slots=2), *PATHS[path], "--dry-run",
                              SCRIPT, "--out", str(out), "x y"], capsys)
    assert code == 0, err
    assert fakes.calls(tools) == [] and not out.exists()
    assert "deepspeed-atlas --dry-run: nothing was launched." in stdout
    assert re.search(r"hostfile \S+:\n  a0 slots=2\n  b0 slots=2\n", stdout), stdout
    nodes = ["a0"] if path == "no_ssh" else ["a0", "b0"]
    for i, host in enumerate(nodes):
        assert f"node {i}: {host} (data center {host[0]}, ranks {2 * i}-{2 * i + 1}" in stdout
    assert "ATLAS_PLAN=" in stdout and "GLOO_SOCKET_IFNAME=lo" in stdout
    if path == "pdsh":
        assert ("ssh check (run here before the launch): ssh -o PasswordAuthentication=no a0 hostname"
                in stdout)
        for i, host in enumerate(nodes):
            line = next(x for x in stdout.splitlines() if x.startswith(f"  command (pdsh, on {host}): "))
            assert f"--node_rank={i}" in line and "export ATLAS_LAUNCHER=pdsh;" in line
            assert line.endswith(f"{SCRIPT} --out {out} 'x y'")
    elif path == "no_ssh":
        assert "command (run here): " in stdout and "--node_rank=0" in stdout
    else:
        cmd = next(x for x in stdout.splitlines() if x.startswith("command (run here): "))
        assert cmd.split()[3] == {"openmpi": "mpirun", "slurm": "srun"}[path]
        local = {"openmpi": "OMPI_COMM_WORLD_LOCAL_RANK", "slurm": "SLURM_LOCALID"}[path]
        assert f"local rank from {local}" in stdout


def _four_hosts(tmp_path):
    return _topology(tmp_path, slots=4, name="four.json", more=lambda r: (
        r["datacenters"]["a"]["hosts"].append({"name": "a1", "slots": 4}),
        r["datacenters"]["b"]["hosts"].append({"name": "b1", "slots": 4}),
        r["model"].update(global_batch=8, dp=2)))


def test_include_and_exclude_select_before_planning(tmp_path):
    topo = _four_hosts(tmp_path)
    whole = prepare(["--atlas-topology", topo, "--exclude", "a0@a1:2,3@b0@b1:2,3", SCRIPT], environ={})
    assert whole.hostfile_text == "a1 slots=2\nb1 slots=2\n" and "--include" not in whole.argv
    slots = prepare(["--atlas-topology", topo, "-i", "a0:1,3@b1:0,2", SCRIPT], environ={})
    assert slots.hostfile_text == "a0 slots=4\nb1 slots=4\n"          # DeepSpeed checks ids against these
    assert slots.argv[slots.argv.index("--include") + 1] == "a0:1,3@b1:0,2"
    assert [h.name for h in slots.plan.hosts] == ["a0", "b1"]
    prefix = prepare(["--atlas-topology", topo, "--include", "a0:0,1@b0:0,1", "--launcher", "openmpi",
                      SCRIPT], environ={})
    assert "--include" not in prefix.argv and prefix.hostfile_text == "a0 slots=2\nb0 slots=2\n"
    with pytest.raises(ValueError, match=r"the openmpi launcher cannot pin ranks to slot ids"):
        prepare(["--atlas-topology", topo, "-i", "a0:1,3@b1:0,2", "--launcher", "openmpi", SCRIPT],
                environ={})
    with pytest.raises(ValueError, match=r"--include 'zz': Hostname 'zz' not found"):
        prepare(["--atlas-topology", topo, "--include", "zz", SCRIPT], environ={})
    with pytest.raises(ValueError, match=r"too few GPUs for the plan"):
        prepare(["--atlas-topology", topo, "--include", "a0:0", SCRIPT], environ={})


@pytest.mark.slow
def test_single_node_launch(tools, tmp_path, capsys):
    """One host: DeepSpeed's local path (no ssh check, 127.0.0.1), the ranks inherit the environment."""
    topo = tmp_path / "one.json"
    topo.write_text(json.dumps({"datacenters": {"a": {"hosts": [{"name": "localhost", "slots": 2}]}},
                                "timeout_s": 7,
                                "model": {"layers": 2, "hidden": 8, "seq": 4, "global_batch": 4,
                                          "pp": 2, "tp": 1, "dp": 1}}))
    out = tmp_path / "out"
    code, stdout, err = _run(["--atlas-topology", str(topo), "--master_port", str(free_port()), SCRIPT,
                              "--out", str(out), "x y"], capsys)
    assert code == 0, stdout + err
    ranks = _ranks(out)
    assert sorted(ranks) == [0, 1] and fakes.calls(tools) == []
    for rank, r in ranks.items():
        assert r["rest"] == ["x y"] and r["world"] == 2 and r["local_rank"] == str(rank)
        assert r["env"]["COMMWEAVE_TIMEOUT_S"] == "7.0"          # the topology's timeout_s


def test_pdsh_line_refuses_unquotable_values_that_passed_no_check(tools, tmp_path):
    """Defence in depth: DeepSpeed writes --master_addr, --master_port and the log path into the
    remote shell line unquoted; even a value that skipped the argument checks cannot become a command."""
    import argparse

    from launch.run.launchers import _pdsh_runner

    for field, value in [("master_addr", "fe80::1%x;touch${IFS}PWNED;#"), ("master_port", "1;id"),
                         ("enable_each_rank_log", "/tmp/log dir")]:
        args = argparse.Namespace(master_addr="127.0.0.1", master_port=29500, ssh_port=None,
                                  launcher_args="", venv_script=None, no_python=False, module=False,
                                  no_local_rank=False, save_pid=False, enable_each_rank_log=None,
                                  user_script=SCRIPT, user_args=[])
        setattr(args, field, value)
        runner = _pdsh_runner()(args, "e30=")
        with pytest.raises(ValueError, match=re.escape(repr(value)) + ".*remote shell line"):
            runner.get_cmd({}, {"a0": [0]})
    assert fakes.calls(tools) == []
