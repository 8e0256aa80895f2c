"""``deepspeed-atlas --dry-run``: what would run on every node, and nothing launched.

DeepSpeed's ``runner.main`` runs as for a real launch (the same arguments, hostfile, exports and
launcher subclasses), with its ``subprocess`` module replaced by a recorder: the ssh checks are
recorded and answered as reachable, and the launch command is kept instead of started. The report
gives, per node of the plan, the command that node runs (pdsh: its remote shell line, ``%n``
replaced; the MPI launchers and srun: the one command started here, which starts every node), the
environment it receives, what :func:`launch.run.runtime.init` sets there from its data center, and the
hostfile.
"""

from __future__ import annotations

import shlex
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from shlex import split
from unittest import mock

from launch.run.launchers import _RUNNERS, STARTS_SCRIPT

_LOCAL_RANK_FROM = {"pdsh": "LOCAL_RANK (deepspeed.launcher.launch)",
                    "openmpi": "OMPI_COMM_WORLD_LOCAL_RANK", "slurm": "SLURM_LOCALID",
                    "mpich": "LOCAL_RANK (DeepSpeed's launcher_helper, from MPI_LOCALRANKID)",
                    "impi": "LOCAL_RANK (-env LOCAL_RANK)"}


class _Stop(Exception):
    pass


@dataclass
class Captured:
    """What DeepSpeed's runner would have run: the ssh checks, the command, its environment."""

    checks: list[list[str]] = field(default_factory=list)
    cmd: list[str] | None = None
    env: dict | None = None
    runners: list = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


@contextmanager
def capture():
    """Run DeepSpeed's ``runner.main`` inside the block without running anything (see the module
    docstring); a launcher not installed here counts as present and is listed in ``missing``."""
    from deepspeed.launcher import runner

    seen = Captured()

    class Recorder:
        CalledProcessError = runner.subprocess.CalledProcessError
        DEVNULL = runner.subprocess.DEVNULL

        @staticmethod
        def check_call(cmd, **kw):
            seen.checks.append(list(cmd))
            return 0

        @staticmethod
        def check_output(cmd, **kw):
            seen.checks.append(list(cmd))
            return b"<first-address-of-the-first-host>\n"

        @staticmethod
        def Popen(cmd, env=None, **kw):
            seen.cmd, seen.env = list(cmd), dict(env or {})
            raise _Stop

    def present(original):
        def exists(self):
            if not original(self):
                seen.missing.append(self.name)
            return True

        return exists

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(runner, "subprocess", Recorder))
        for attr, _ in _RUNNERS.values():
            cls = getattr(runner, attr)
            stack.enter_context(mock.patch.object(cls, "backend_exists", present(cls.backend_exists)))
        with suppress(_Stop):
            yield seen


def report(seen: Captured, launch, hostfile_path: str) -> str:
    """The dry run as a person reads it (``launch`` is :class:`launch.run.runner.Launch`)."""
    plan, launcher = launch.plan, launch.launcher
    lines = ["deepspeed-atlas --dry-run: nothing was launched.", f"hostfile {hostfile_path}:"]
    lines += [f"  {line}" for line in launch.hostfile_text.splitlines()]
    for check in seen.checks:
        lines.append(f"ssh check (run here before the launch): {shlex.join(check)}")
    if seen.cmd is None:
        lines.append("DeepSpeed's runner stopped before launching anything")
        return "\n".join(lines)
    local = not seen.runners
    if local:
        lines.append("launcher: none (this machine runs its node's ranks: DeepSpeed's local path); "
                     "the ranks inherit this environment")
    else:
        note = " (not installed on this machine)" if seen.missing else ""
        lines.append(f"launcher: {launcher}{note}")
    exported = {} if local else getattr(seen.runners[0], "exported", {})
    if local:
        exported = {k: v for k, v in seen.env.items() if k in launch.env}
    started_here = local or launcher != "pdsh"
    if started_here:
        lines.append(f"command (run here): {shlex.join(seen.cmd)}")
    remote = _pdsh_remote(seen.cmd, launch) if not started_here else None
    if remote is not None:
        lines.append(f"command (run here): {shlex.join(seen.cmd[:_pdsh_start(launch)])} REMOTE-LINE "
                     "(per node below)")
    names = [h.name for h in plan.hosts]
    nodes = [launch.node] if local and launch.node else names
    first = 0
    for h in plan.hosts:
        lo, first = first, first + h.slots
        if h.name not in nodes:
            continue
        i = names.index(h.name)
        lines.append(f"node {i}: {h.name} (data center {h.dc}, ranks {lo}-{first - 1}, "
                     f"local rank from {_LOCAL_RANK_FROM['pdsh' if local else launcher]})")
        if remote is not None:
            lines.append(f"  command (pdsh, on {h.name}): {remote.replace('%n', str(i))}")
        lines.append("  environment:")
        lines += [f"    {k}={shlex.quote(v)}" for k, v in sorted(exported.items())]
        if h.ifname:
            lines.append(f"  set by atlas.init() on the node (its data center's ifname): "
                         f"GLOO_SOCKET_IFNAME={h.ifname} NCCL_SOCKET_IFNAME=={h.ifname}")
    if launcher in STARTS_SCRIPT and not local:
        lines.append("  (every rank: RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/MASTER_PORT are set by "
                     "atlas.init() from the launcher's variables and ATLAS_MASTER_ADDR/ATLAS_MASTER_PORT)")
    return "\n".join(lines)


def _pdsh_start(launch) -> int:
    """Where the remote shell line starts in ``pdsh -S -f N -w HOSTS [launcher args] LINE...``."""
    return 6 + len(split(launch.launcher_args))


def _pdsh_remote(cmd: list[str], launch) -> str:
    """The shell line pdsh runs on every host."""
    return " ".join(cmd[_pdsh_start(launch):])
