"""deepspeed-atlas as a drop-in for ``deepspeed``: every option of DeepSpeed's runner, taken from its own
parser (so an option DeepSpeed adds fails here until launch/run/launchers.py places it), through
``--dry-run`` on every launcher path: it appears in the command line the nodes run, or acts here (the
plan, the rendezvous, the ssh check), or is refused with the reason. Script arguments reach the script
verbatim whatever their names (``--atlas``, ``--dry-run``, abbreviations of ours). ``--hostfile``,
``--num_nodes`` and ``--num_gpus`` restrict the plan as in ``deepspeed``, or are refused when the topology
contradicts them.
"""

import shlex
import shutil
import sys

import pytest

from launch.run import launchers
from launch.run.runner import deepspeed_parser, main, prepare
from tests.launch.run.test_launchers import _topology

SCRIPT = "train.py"
ARGS = ["--atlas", "--atlas-top", "x", "--dry-run", "--hostfile", "h", "--bind_cores_to_rank"]
PATH_ARGS = {"local": ["--no_ssh", "--node_rank", "0"], **{p: ["--launcher", p] for p in launchers.SUPPORTED}}
VALUES = {  # dest -> the arguments that set it away from its default
    "module": ["--module"], "no_python": ["--no_python"], "no_local_rank": ["--no_local_rank"],
    "save_pid": ["--save_pid"], "enable_each_rank_log": ["--enable_each_rank_log", "/tmp/rank-logs"],
    "bind_cores_to_rank": ["--bind_cores_to_rank"], "bind_core_list": ["--bind_core_list", "0-1"],
    "log_level": ["--log_level", "debug"], "quiet": ["--quiet"], "launcher_args": ["--launcher_args=-v"],
    "ssh_port": ["--ssh_port", "2222"], "venv_script": ["--venv_script", "/tmp/venv/activate"],
    "autotuning": ["--autotuning", "tune"],
}
DS_LAUNCH = ("local", "pdsh")      # paths that run deepspeed.launcher.launch on the node


def _evidence(path: str, dest: str) -> tuple[list[str], list[str]]:
    """What the node command must contain, and must not, when ``dest`` is set on ``path``."""
    if dest == "venv_script":
        return ["source /tmp/venv/activate;"], []
    if path in DS_LAUNCH:
        flag = VALUES[dest]
        return [f"{flag[0]}={flag[1]}" if len(flag) == 2 else flag[0]], []
    python = f"{sys.executable} -u"
    if dest == "module":
        return ([f"{python} -m {SCRIPT}"] if path != "mpich" else ["--module"]), []
    if dest == "no_python":
        return (["--no_python"], []) if path == "mpich" else ([], [python])
    if dest == "no_local_rank":
        return [], ["--local_rank"]            # these launchers pass none anyway
    return {"bind_cores_to_rank": ["numactl"], "bind_core_list": ["numactl"]}.get(dest, []), []


def test_every_runner_option_is_placed():
    """The table covers exactly DeepSpeed's runner options (its parser's, minus ATLAS's own)."""
    parser = deepspeed_parser()
    ours = {a.dest for g in parser._action_groups if g.title.startswith("ATLAS") for a in g._group_actions}
    stock = {a.dest for a in parser._actions} - ours - {"help"}
    assert stock == set(launchers.HERE) | set(launchers.NODE)
    assert not set(launchers.HERE) & set(launchers.NODE)
    assert not parser.allow_abbrev


def _dry_run(tmp_path, capsys, argv):
    try:
        main(["--atlas-topology", _topology(tmp_path), "--dry-run", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _node_line(path: str, out: str) -> str:
    lines = out.splitlines()
    if path == "pdsh":
        return next(x for x in lines if x.startswith("  command (pdsh, on b0): "))
    return next(x for x in lines if x.startswith("command (run here): "))


@pytest.mark.parametrize("path", list(PATH_ARGS))
@pytest.mark.parametrize("dest", list(VALUES))
def test_each_node_option_reaches_the_nodes_or_is_refused(path, dest, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused = launchers.REFUSED_OPTIONS.get(path, {}).get(dest)
    if dest.startswith("bind_core") and path == "impi" and refused is None and not shutil.which("numactl"):
        pytest.skip("impi binds through numactl, not installed here")
    code, out, err = _dry_run(tmp_path, capsys, [*PATH_ARGS[path], *VALUES[dest], SCRIPT, *ARGS])
    if refused is not None:
        assert code == 2 and f"--{dest} " in err and refused.format(launcher=path) in err, err
        return
    assert code == 0, err
    line = _node_line(path, out)
    assert line.endswith(f"{SCRIPT} {shlex.join(ARGS)}"), line         # script arguments untouched
    if dest == "launcher_args":               # the launcher's own command (pdsh: before the remote line)
        assert " -w a0,b0 -v " in out if path == "pdsh" else " -v " in line, out
        return
    if dest == "ssh_port":                    # pdsh: DeepSpeed's ssh check and PDSH_SSH_ARGS_APPEND
        assert "ssh -o PasswordAuthentication=no -p 2222 a0 hostname" in out, out
        return
    present, absent = _evidence(path, dest)
    for token in present:
        assert token in line, (token, line)
    for token in absent:
        assert token not in line, (token, line)


@pytest.mark.parametrize("path", list(PATH_ARGS))
def test_options_acting_here(path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [*PATH_ARGS[path], "--master_port", "29555", "--master_addr", "127.0.0.3", "--no_ssh_check",
            "--force_multi", SCRIPT, *ARGS]
    code, out, err = _dry_run(tmp_path, capsys, argv)
    assert code == 0, err
    assert "ssh check" not in out and "29555" in out and "127.0.0.3" in out


def test_hostfile_num_nodes_and_num_gpus_restrict_the_plan(tmp_path):
    from tests.launch.run.test_launchers import _four_hosts

    topo = _four_hosts(tmp_path)            # a0 a1 | b0 b1, 4 slots each; pp=2 tp=1 dp=2
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("b1 slots=2\na1 slots=2\n# a comment\n")
    launch = prepare(["--atlas-topology", topo, "--hostfile", str(hostfile), SCRIPT], environ={})
    assert launch.hostfile_text == "a1 slots=2\nb1 slots=2\n"
    assert "--num_gpus" not in launch.argv and launch.argv.count("--hostfile") == 1
    launch = prepare(["--atlas-topology", topo, "--num_gpus", "2", SCRIPT], environ={})
    assert {h.slots for h in launch.plan.hosts} == {2} and "--num_gpus" not in launch.argv
    launch = prepare(["--atlas-topology", topo, "--hostfile", str(hostfile), "--num_nodes", "2",
                      "--num_gpus", "2", SCRIPT], environ={})
    assert sorted(h.name for h in launch.plan.hosts) == ["a1", "b1"]


@pytest.mark.parametrize("argv, hosts, message", [
    (["--num_gpus", "8"], None, "--num_gpus 8: more than these hosts offer"),
    (["--num_nodes", "5"], None, "--num_nodes 5: "),
    (["--num_nodes", "0"], None, "--num_nodes=0: must be an integer in [1,"),
    (["--num_nodes", "1", "--include", "a0"], None, "cannot be combined with --include/--exclude"),
    (["--hostfile", "HOSTFILE"], "c0 slots=4\n", "host 'c0' is not in"),
    (["--hostfile", "HOSTFILE"], "a0 slots=16\n", "a0 slots=16, but"),
    (["--hostfile", "HOSTFILE"], "a0 slots=4\na0 slots=4\n", "multiple entries for a0"),
    (["--hostfile", "HOSTFILE"], "a0 slots=4\nb0 four\n", "bad entry"),
    (["--hostfile", "MISSING"], None, "--hostfile=") ,
    (["--num_nodes", "1", "--num_gpus", "2"], None, "too few GPUs for the plan"),   # 2 of a0's slots
])
def test_contradictions_with_the_topology_are_refused(tmp_path, argv, hosts, message):
    from tests.launch.run.test_launchers import _four_hosts

    path = tmp_path / "hostfile"
    if hosts is not None:
        path.write_text(hosts)
    named = {"HOSTFILE": str(path), "MISSING": str(tmp_path / "missing")}
    argv = [named.get(a, a) for a in argv]
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        prepare(["--atlas-topology", _four_hosts(tmp_path), *argv, SCRIPT], environ={})


@pytest.mark.parametrize("path", ["local", "pdsh"])
def test_a_measured_link_window_replaces_the_assumed_one(path, tmp_path, capsys, monkeypatch):
    """``--link A:B=FILE`` (as ``python -m launch.plan`` takes it): the window of benchmarks.wan's JSON is
    the one planned from (the printed inputs say measured, and the plan's connection count follows the
    window), ``--link`` stays with deepspeed-atlas, the script's own ``--link`` reaches the script."""
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    wan = tmp_path / "wan.json"
    wan.write_text('{"window_mb": 0.25}')
    slow = lambda raw: raw["wan"][0].update(rtt_ms=100, bandwidth_gbps=10)  # noqa: E731
    topo = _topology(tmp_path, slots=2, wan=slow)
    argv = ["--atlas-topology", topo, "--dry-run", *PATH_ARGS[path]]
    assumed = prepare([*argv, SCRIPT])
    measured = prepare([*argv, "--link", f"a:b={wan}", SCRIPT, "--link", "x"])
    assert "TCP window 2 MiB per connection assumed" in assumed.text, assumed.text
    assert f"TCP window 0.25 MiB per connection measured: {wan}" in measured.text, measured.text
    # a connection carries 8x less at the measured window: the planner opens more of them
    assert measured.plan.connections > assumed.plan.connections
    assert measured.argv[-3:] == [SCRIPT, "--link", "x"] and "--link" not in measured.argv[:-2]
    main([*argv, f"--link=a:b={wan}", SCRIPT])
    out = capsys.readouterr().out
    assert "measured" in out and "--link" not in _node_line(path, out), out


@pytest.mark.parametrize("spec, message", [
    ("a:b", "use A:B=FILE"), ("a:c={wan}", "c"), ("a:b={empty}", "has no window_mb")])
def test_a_bad_link_is_refused_before_anything_launches(spec, message, tmp_path):
    wan, empty = tmp_path / "wan.json", tmp_path / "empty.json"
    wan.write_text('{"window_mb": 1}')
    empty.write_text("{}")
    with pytest.raises(ValueError, match=message):
        prepare(["--atlas-topology", _topology(tmp_path), "--dry-run", "--link",
                 spec.format(wan=wan, empty=empty), SCRIPT])
