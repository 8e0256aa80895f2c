"""How ``deepspeed-atlas`` hands the plan to each of DeepSpeed's launchers, and its dry run.

DeepSpeed builds one command per ``--launcher``; each carries the exported environment its own way,
and only some of those ways are safe for arbitrary values. ATLAS swaps in a subclass of each runner it
supports (for the duration of the call) that carries every value verbatim, and refuses the rest:

    launcher  values travel as                               a rank's local index from
    pdsh      a remote shell line: ``export K='v';``,       LOCAL_RANK (deepspeed.launcher.launch)
              arguments quoted (shlex.quote)
    openmpi   mpirun arguments ``-x K=v`` (no shell)         OMPI_COMM_WORLD_LOCAL_RANK
    slurm     srun's own environment + ``--export=ALL``     SLURM_LOCALID, host SLURMD_NODENAME
              (``--export=ALL,K=v`` splits v at commas)
    mpich     mpirun arguments ``-genv K v``                 LOCAL_RANK (DeepSpeed's launcher_helper,
                                                             from MPI_LOCALRANKID / PALS_LOCAL_RANKID)
    impi      mpirun arguments ``-genv K v``                 LOCAL_RANK (``-env LOCAL_RANK j``)
    mvapich   refused (:data:`REFUSED`)

DeepSpeed's own runners differ in three unsafe ways: pdsh double-quotes exported values (``$(...)``,
backticks and ``$VAR`` still expand on the node) and joins arguments with spaces; openmpi, mpich and
impi put those double quotes into the value itself; slurm splits values at commas; mpich passes
``-genv K=v`` where Hydra takes two arguments. The ranks of openmpi and slurm get no RANK/LOCAL_RANK
from DeepSpeed at all: :func:`launch.run.runtime.init` reads the launcher's own variables
(``ATLAS_LAUNCHER`` names the launcher) and never assumes local rank 0.
"""

from __future__ import annotations

import re
import shlex
import sys
from contextlib import ExitStack, contextmanager
from unittest import mock

_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

SUPPORTED = ("pdsh", "openmpi", "slurm", "mpich", "impi")
REFUSED = {
    "mvapich": "DeepSpeed's mvapich runner needs MVAPICH2-GDR (a CUDA build it checks with `mpiname`) "
               "and writes its hostfile to the fixed path /tmp/deepspeed_mvapich_hostfile, shared by "
               "every job on the machine; ATLAS does not adapt it. Use --launcher pdsh, openmpi, slurm, "
               "mpich or impi",
}
# Launchers that start the user script themselves (no deepspeed.launcher.launch on the node), so the
# ranks need the master address from the launcher: exported as ATLAS_MASTER_ADDR / ATLAS_MASTER_PORT.
STARTS_SCRIPT = ("openmpi", "slurm")
# Launchers that cannot pin a rank to a slot id: a filter must keep the first slots of each host.
NO_SLOT_IDS = ("openmpi", "slurm", "mpich", "impi")
UNIFORM_SLOTS = ("slurm", "mpich", "impi")


# Every option of DeepSpeed's runner, and how it reaches the job on each path ("local": --no_ssh or a
# one-host plan, where DeepSpeed's runner starts deepspeed.launcher.launch here). An option acts here (the
# plan, the runner, the ssh check) or on the node command: there it is carried on every path that has a
# way to carry it, and refused on the others with the reason (it used to be dropped without a word:
# --bind_cores_to_rank on pdsh). tests/launch/run/test_passthrough.py checks every option of the parser
# against this table on every path, so an option DeepSpeed adds fails the test until it is placed here.
PATHS = ("local", *SUPPORTED)
HERE = {  # dest -> what deepspeed-atlas or DeepSpeed's runner does with it here
    "hostfile": "restricts the plan to its hosts and slots (each checked against the topology)",
    "include": "restricts the plan to these hosts/slots",
    "exclude": "removes these hosts/slots from the plan",
    "num_nodes": "the plan may use the first N hosts (of --hostfile, else of the topology)",
    "num_gpus": "the plan may use the first N slots of every host",
    "master_port": "the rendezvous port (every node)", "master_addr": "the rendezvous address (every node)",
    "node_rank": "with --no_ssh: this host's index in the plan's hostfile",
    "launcher": "the path", "no_ssh": "the path: this host's ranks only",
    "no_ssh_check": "skips DeepSpeed's ssh check", "force_multi": "the multi-node path for a one-host plan",
    "user_script": "the script", "user_args": "its arguments, verbatim",
}
NODE = ("module", "no_python", "no_local_rank", "save_pid", "enable_each_rank_log", "bind_cores_to_rank",
        "bind_core_list", "log_level", "quiet", "launcher_args", "ssh_port", "venv_script", "autotuning")
_MPI_STARTS = ("{launcher} starts the script itself (no deepspeed.launcher.launch on the node) and has no "
               "equivalent: ")
_NO_BIND = "bind ranks to cores with the launcher's own option in --launcher_args (mpirun --bind-to core)"
REFUSED_OPTIONS = {  # path -> {dest: why it cannot reach the nodes there}
    "local": {"launcher_args": "no launcher runs on this path (this machine starts its ranks itself)",
              "ssh_port": "no ssh on this path", "venv_script": "DeepSpeed sources it only on pdsh's "
                                                               "remote shell; activate it here"},
    "openmpi": {"save_pid": _MPI_STARTS + "no launcher process writes a pid file",
                "enable_each_rank_log": _MPI_STARTS + "use mpirun --output-filename in --launcher_args",
                "bind_cores_to_rank": _MPI_STARTS + _NO_BIND, "bind_core_list": _MPI_STARTS + _NO_BIND,
                "ssh_port": "mpirun reaches the nodes with its own ssh settings: --launcher_args "
                            "'--mca plm_rsh_args \"-p N\"'",
                "venv_script": "DeepSpeed sources it only on pdsh's remote shell"},
    "slurm": {"save_pid": _MPI_STARTS + "no launcher process writes a pid file",
              "enable_each_rank_log": _MPI_STARTS + "use srun --output in --launcher_args",
              "bind_cores_to_rank": _MPI_STARTS + "srun --cpu-bind=cores in --launcher_args",
              "bind_core_list": _MPI_STARTS + "srun --cpu-bind=map_cpu:... in --launcher_args",
              "ssh_port": "srun does not use ssh", "venv_script": "DeepSpeed sources it only on pdsh"},
    "mpich": {"save_pid": _MPI_STARTS + "no launcher process writes a pid file",
              "enable_each_rank_log": _MPI_STARTS + "use mpirun -outfile-pattern in --launcher_args",
              "bind_cores_to_rank": _MPI_STARTS + "mpirun -bind-to core in --launcher_args",
              "bind_core_list": _MPI_STARTS + "mpirun -bind-to user:... in --launcher_args",
              "ssh_port": "Hydra reaches the nodes with its own launcher settings (-launcher-exec)",
              "venv_script": "DeepSpeed sources it only on pdsh's remote shell"},
    "impi": {"save_pid": _MPI_STARTS + "no launcher process writes a pid file",
             "enable_each_rank_log": _MPI_STARTS + "use mpirun -outfile-pattern in --launcher_args",
             "ssh_port": "Intel MPI reaches the nodes with its own bootstrap settings (-bootstrap-exec-args)",
             "venv_script": "DeepSpeed sources it only on pdsh's remote shell"},
}
for _path in PATHS:   # DeepSpeed's autotuner launches its own experiments over the hostfile, not the plan
    REFUSED_OPTIONS.setdefault(_path, {})["autotuning"] = (
        "DeepSpeed's autotuner launches its own experiments on the whole hostfile, not on the plan; tune "
        "with plain deepspeed on one data center, then launch the result with deepspeed-atlas")


def check_options(path: str, args, parser) -> None:
    """Refuse every node option set (not at its default) that ``path`` cannot carry, with the reason."""
    for dest, why in REFUSED_OPTIONS.get(path, {}).items():
        if getattr(args, dest) != parser.get_default(dest):
            where = "--no_ssh or a one-host plan" if path == "local" else f"--launcher {path}"
            raise ValueError(f"--{dest} {getattr(args, dest)!r} cannot reach the nodes with {where}: "
                             f"{why.format(launcher=path)}")


def check_env_name(key: str) -> str:
    key = key.strip()
    if not _SHELL_NAME.fullmatch(key):
        raise ValueError(f"environment variable {key!r} cannot be exported to the nodes: a name must match "
                         "[A-Za-z_][A-Za-z0-9_]*")
    return key


def shell_export(key: str, value: str) -> tuple[str, str]:
    """A ``(name, value)`` pair that ``export NAME=VALUE;`` in a POSIX shell sets verbatim and that
    runs nothing: the name must be a shell name, the value is single-quoted by ``shlex.quote``."""
    return check_env_name(key), shlex.quote(value.strip())


def _shell_safe(value: str, what: str) -> str:
    if shlex.quote(value) != value:
        raise ValueError(f"{what} {value!r}: DeepSpeed's pdsh command puts it unquoted into the remote "
                         "shell line; use only letters, digits and _ + - . / : @ % , =")
    return value


def _keep(runner, key: str, value: str) -> str:
    """Check the name; remember the value as the node will see it (the dry run prints it)."""
    name = check_env_name(key)
    runner.__dict__.setdefault("exported", {})[name] = value.strip()
    return name


def _pdsh_runner():
    from deepspeed.launcher.multinode_runner import PDSHRunner

    class AtlasPDSHRunner(PDSHRunner):
        """pdsh: every value single-quoted for the remote shell, every argument one shell word."""

        def add_export(self, key, var):
            name, value = shell_export(_keep(self, key, var), var)
            self.exports[name] = value

        def parse_user_args(self):
            return [shlex.quote(a) for a in self.args.user_args]

        def get_cmd(self, environment, active_resources):
            import os

            _shell_safe(os.path.abspath("."), "the working directory")
            _shell_safe(sys.executable, "the Python interpreter")
            if self.args.venv_script is not None:
                _shell_safe(self.args.venv_script, "--venv_script")
            # DeepSpeed writes these into the remote shell line unquoted: validated on the way in
            # (topology.check_addr), checked again here so that no value becomes a second command.
            _shell_safe(str(self.args.master_addr), "--master_addr")
            _shell_safe(str(self.args.master_port), "--master_port")
            _shell_safe(self.world_info_base64, "the world info")
            if self.args.enable_each_rank_log:
                _shell_safe(self.args.enable_each_rank_log, "--enable_each_rank_log")
            self.user_script = shlex.quote(self.args.user_script)
            cmd, kill, env = super().get_cmd(environment, active_resources)
            # DeepSpeed's pdsh line drops these (its local path and deepspeed.launcher.launch take them)
            extra = ["--bind_cores_to_rank"] if self.args.bind_cores_to_rank else []
            if self.args.bind_core_list is not None:
                extra.append(shlex.quote(f"--bind_core_list={self.args.bind_core_list}"))
            extra += [f"--log_level={self.args.log_level}"] + (["--quiet"] if self.args.quiet else [])
            at = len(cmd) - len(self.user_arguments) - 1          # the script
            return cmd[:at] + extra + cmd[at:], kill, env

    return AtlasPDSHRunner


def _openmpi_runner():
    from deepspeed.launcher.multinode_runner import OpenMPIRunner

    class AtlasOpenMPIRunner(OpenMPIRunner):
        """openmpi: ``-x K=v`` is an argument, not shell text: the value goes as it is, unquoted."""

        def add_export(self, key, var):
            self.exports[_keep(self, key, var)] = var.strip()

    return AtlasOpenMPIRunner


def _slurm_runner():
    from deepspeed.launcher.multinode_runner import SlurmRunner

    class AtlasSlurmRunner(SlurmRunner):
        """slurm: the values go into srun's own environment, which ``--export=ALL`` passes on whole;
        the plan's hosts are named in order, the same number of tasks on each, filled host by host."""

        hosts: tuple[str, ...] = ()
        per_node = 0

        def add_export(self, key, var):
            self.exports[_keep(self, key, var)] = var.strip()

        def get_cmd(self, environment, active_resources):
            environment.update(self.exports)
            self.exports = {}
            cmd = super().get_cmd(environment, active_resources)
            # DeepSpeed's srun line always runs "python -u SCRIPT": --no_python and --module were ignored
            at = len(cmd) - len(self.user_arguments) - 3
            if self.args.no_python:
                del cmd[at:at + 2]
            elif self.args.module:
                cmd.insert(at + 2, "-m")
            at = cmd.index("-n") + 2
            placement = ["--nodelist", ",".join(self.hosts), "--nodes", str(len(self.hosts)),
                         "--ntasks-per-node", str(self.per_node), "--distribution", "block"]
            return [*cmd[:at], *placement, *cmd[at:]]

    return AtlasSlurmRunner


def _mpich_runner():
    from deepspeed.launcher.multinode_runner import MPICHRunner

    class AtlasMPICHRunner(MPICHRunner):
        """mpich: Hydra's ``-genv`` takes the name and the value as two arguments."""

        def add_export(self, key, var):
            self.exports[_keep(self, key, var)] = var.strip()

        def get_cmd(self, environment, active_resources):
            exports, self.exports = self.exports, {}
            cmd = super().get_cmd(environment, active_resources)
            at = cmd.index("-genv")
            return cmd[:at] + [x for k, v in exports.items() for x in ("-genv", k, v)] + cmd[at:]

    return AtlasMPICHRunner


def _impi_runner():
    from deepspeed.launcher.multinode_runner import IMPIRunner

    class AtlasIMPIRunner(IMPIRunner):
        """impi: ``-genv K v`` already; only DeepSpeed's double quotes come off the value."""

        def add_export(self, key, var):
            self.exports[_keep(self, key, var)] = var.strip()

    return AtlasIMPIRunner


_RUNNERS = {"pdsh": ("PDSHRunner", _pdsh_runner), "openmpi": ("OpenMPIRunner", _openmpi_runner),
            "slurm": ("SlurmRunner", _slurm_runner), "mpich": ("MPICHRunner", _mpich_runner),
            "impi": ("IMPIRunner", _impi_runner)}


def check_launcher(name: str) -> str:
    name = name.lower()
    if name in REFUSED:
        raise ValueError(f"--launcher {name}: {REFUSED[name]}")
    if name not in SUPPORTED:
        raise ValueError(f"--launcher {name!r}: ATLAS supports {', '.join(SUPPORTED)}")
    return name


@contextmanager
def atlas_runners(slurm_hosts: tuple[str, ...] = (), slurm_per_node: int = 0, record: list | None = None):
    """DeepSpeed's runner classes replaced by the ATLAS subclasses for the duration of the block
    (``runner.main`` builds the runner by name from its module globals at call time). ``record``
    receives every runner built (the dry run prints their exports)."""
    from deepspeed.launcher import runner

    with ExitStack() as stack:
        for name, (attr, make) in _RUNNERS.items():
            cls = make()
            if name == "slurm":
                cls.hosts, cls.per_node = slurm_hosts, slurm_per_node
            if record is not None:
                cls = _recording(cls, record)
            stack.enter_context(mock.patch.object(runner, attr, cls))
            stack.enter_context(mock.patch.dict(runner.LAUNCHER_CLASSES, {name: cls}))
        yield


def _recording(cls, record: list):
    class Recorded(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            record.append(self)

    Recorded.__name__ = cls.__name__
    return Recorded


@contextmanager
def exported_prefixes(prefixes: list[str]):
    """Add name prefixes to DeepSpeed's ``runner.EXPORT_ENVS`` for the duration of the block."""
    from deepspeed.launcher import runner

    added = [p for p in prefixes if p not in runner.EXPORT_ENVS]
    runner.EXPORT_ENVS.extend(added)
    try:
        yield
    finally:
        for p in added:
            runner.EXPORT_ENVS.remove(p)
