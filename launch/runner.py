"""``deepspeed-atlas``: DeepSpeed's launcher with ATLAS's plan in front of it.

    deepspeed-atlas --atlas-topology configs/atlas_two_dc.json --wan-connections 8 \\
        [every deepspeed runner argument] train.py [script arguments]

1. reads and validates the topology (and model) file, checks the NCCL knobs, and computes the plan
   (:mod:`launch.plan`); any mistake stops here with a ``ValueError`` message, before anything runs;
2. writes the DC-ordered hostfile and passes it as ``--hostfile`` (global ranks follow hostfile order,
   so the stages land in their data centers), and ``--master_addr`` from the first host's ``addr``
   (a one-host plan runs here: 127.0.0.1 and no ssh check, as plain ``deepspeed`` does without one);
3. sets ATLAS_*, NCCL_* (and on ``--no_ssh`` this node's GLOO/NCCL interface) in the environment and
   hands over to DeepSpeed's own ``runner.main``: single node and ``--no_ssh --node_rank`` children
   inherit the environment, the pdsh path exports it. DeepSpeed exports only a fixed list of name
   prefixes, so GLOO/NCCL/TORCH_GLOO/ATLAS are added for the call (and removed after); pdsh runs the
   export in a remote shell, where DeepSpeed's double quotes would still expand ``$(...)`` and
   backticks, so each value is quoted with ``shlex.quote`` and a variable name must be a shell name.

With ``--no_ssh``, ``--node_rank`` is this host's index in the plan's hostfile (printed by
``python -m launch.plan``); ``--atlas-host NAME`` or the machine's host name find it instead. A host
the plan does not use exits at once with status 0, so the same command can run on every host.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import shlex
import socket
import sys
import tempfile
import warnings
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from unittest import mock

from launch import runtime, topology
from launch.plan import Plan, load_model, make_plan, render
from launch.sockets import nccl_env, tcp_advice

EXPORT_PREFIXES = ["GLOO", "NCCL", "TORCH_GLOO", "ATLAS"]
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OURS = {"--atlas-topology": True, "--atlas-model": True, "--wan-connections": True,
         "--atlas-sharing": True, "--atlas-host": True, "--atlas-hostfile": True}


class _Captured(Exception):
    pass


def deepspeed_parser() -> argparse.ArgumentParser:
    """DeepSpeed's own runner parser (so every deepspeed argument parses exactly as there), with the
    ATLAS arguments added. ``runner.parse_args`` builds its parser inside; it is captured read-only."""
    from deepspeed.launcher import runner

    box = []

    def capture(parser, args=None, namespace=None):
        box.append(parser)
        raise _Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), suppress(_Captured):
        runner.parse_args([])
    parser = box[0]
    parser.prog = "deepspeed-atlas"
    g = parser.add_argument_group("ATLAS (training across data centers)")
    g.add_argument("--atlas-topology", required=True, metavar="FILE",
                   help="topology JSON: data centers, hosts and slots, WAN rtt_ms/bandwidth_gbps")
    g.add_argument("--atlas-model", metavar="FILE", help="model JSON (else the topology's \"model\")")
    g.add_argument("--wan-connections", type=int, default=8, metavar="N",
                   help="TCP connections per WAN pipeline pair (1..64)")
    g.add_argument("--atlas-sharing", choices=("temporal", "spatial"), default="temporal",
                   help="how DP replicas share a WAN link: take turns (temporal) or at once (spatial)")
    g.add_argument("--atlas-host", metavar="NAME", help="with --no_ssh: this host's name in the topology")
    g.add_argument("--atlas-hostfile", metavar="PATH", help="keep the generated hostfile at PATH")
    return parser


@dataclass
class Launch:
    plan: Plan
    text: str                 # the readable plan
    argv: list[str]           # for deepspeed's runner.main
    env: dict[str, str]       # set in this process before handing over
    hostfile: str
    advice: list[str]
    node: str | None = None   # --no_ssh: this host; None elsewhere
    idle: bool = False        # --no_ssh on a host the plan does not use


def prepare(argv: list[str]) -> Launch:
    """Everything that can fail, before anything launches."""
    from deepspeed.launcher import runner

    args = deepspeed_parser().parse_args(argv)
    script_at = len(argv) - len(args.user_args) - 1
    if argv[script_at] != args.user_script:
        raise ValueError(f"deepspeed-atlas: could not find the script {args.user_script!r} in the arguments")
    if args.hostfile != runner.DLTS_HOSTFILE:
        raise ValueError(f"--hostfile {args.hostfile!r}: the hosts come from --atlas-topology; "
                         "drop --hostfile")
    for name in ("include", "exclude"):
        if getattr(args, name):
            raise ValueError(f"--{name} {getattr(args, name)!r}: would change the planned rank layout; list "
                             "only the hosts and slots to use in the topology file")
    for name in ("num_nodes", "num_gpus"):
        if getattr(args, name) != -1:
            raise ValueError(f"--{name} {getattr(args, name)}: the plan decides the nodes and GPUs used; "
                             "edit the topology file instead")
    topo = topology.load(args.atlas_topology)
    model = load_model(topo, args.atlas_model)
    env = {"ATLAS_WAN_CONNS": str(args.wan_connections), "ATLAS_SHARING": args.atlas_sharing}
    plan = make_plan(topo, model, args.wan_connections, args.atlas_sharing)
    links = [topo.link(plan.stage_dc[s], plan.stage_dc[s + 1]) for s in plan.wan_boundaries()]
    if links:
        env.update(nccl_env(args.wan_connections, links, os.environ))
    env[runtime.ENV_PLAN] = plan.encode()

    head = _drop_ours(argv[:script_at])
    extra = []
    one_host = len(plan.hosts) == 1 and not args.force_multi
    if not args.master_addr and (plan.hosts[0].addr or one_host):
        extra += ["--master_addr", plan.hosts[0].addr or "127.0.0.1"]
    if one_host and not args.no_ssh_check:
        extra.append("--no_ssh_check")   # DeepSpeed would ssh to the only host, this machine
    node = None
    if args.no_ssh:
        node = _this_node(plan, topo, args)
        if node is None:
            return Launch(plan, render(plan, topo, model), [], env, "", [], None, idle=True)
        extra += ["--node_rank", str([h.name for h in plan.hosts].index(node))]
        head = _drop_option(head, "--node_rank")
        ifname = next(h.ifname for h in plan.hosts if h.name == node)
        if ifname:
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", ifname))
            env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", f"={ifname}"))
    hostfile = args.atlas_hostfile or ""
    return Launch(plan, render(plan, topo, model), head + extra + ["--hostfile", hostfile] + argv[script_at:],
                  env, hostfile, tcp_advice(links, args.wan_connections), node)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        launch = prepare(argv)
    except ValueError as e:
        print(f"deepspeed-atlas: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(launch.text, flush=True)
    if launch.idle:
        print("deepspeed-atlas: this host is not used by the plan; nothing to launch", flush=True)
        return
    for line in launch.advice:
        warnings.warn(f"ATLAS: {line}", RuntimeWarning, stacklevel=1)
    from deepspeed.launcher import runner

    with ExitStack() as stack:
        if not launch.hostfile:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="atlas-"))
            launch.hostfile = os.path.join(folder, "hostfile")
            launch.argv[launch.argv.index("--hostfile") + 1] = launch.hostfile
        with open(launch.hostfile, "w") as f:
            f.write(launch.plan.hostfile())
        os.environ.update(launch.env)
        stack.enter_context(exported_prefixes(EXPORT_PREFIXES))
        stack.enter_context(shell_safe_exports())
        runner.main(launch.argv)


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


def shell_export(key: str, value: str) -> tuple[str, str]:
    """A ``(name, value)`` pair that ``export NAME=VALUE;`` in a POSIX shell sets verbatim and that
    runs nothing: the name must be a shell name, the value is single-quoted by ``shlex.quote``."""
    key = key.strip()
    if not _SHELL_NAME.fullmatch(key):
        raise ValueError(f"environment variable {key!r} cannot be exported to the nodes: a name must match "
                         "[A-Za-z_][A-Za-z0-9_]*")
    return key, shlex.quote(value.strip())


@contextmanager
def shell_safe_exports():
    """Quote pdsh's exports safely (DeepSpeed's ``add_export`` uses double quotes, which expand
    ``$(...)``, backticks and ``$VAR`` on the remote shell). The other launchers pass the values as
    arguments, not through a shell, and keep DeepSpeed's behaviour."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner, PDSHRunner

    found = list(inspect.signature(MultiNodeRunner.add_export).parameters)
    if found != ["self", "key", "var"] or "add_export" in PDSHRunner.__dict__:
        raise RuntimeError(f"deepspeed's add_export changed (parameters {found}); refusing to patch it")

    def add_export(self, key, var):
        name, value = shell_export(key, var)
        self.exports[name] = value

    PDSHRunner.add_export = add_export
    try:
        yield
    finally:
        del PDSHRunner.add_export


def _drop_ours(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
            continue
        if tok in _OURS:
            skip = True
            continue
        if any(tok.startswith(opt + "=") for opt in _OURS):
            continue
        out.append(tok)
    return out


def _drop_option(tokens: list[str], option: str) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
        elif tok == option:
            skip = True
        elif not tok.startswith(option + "="):
            out.append(tok)
    return out


def _this_node(plan: Plan, topo, args) -> str | None:
    """--no_ssh: this host's name in the plan (None: a topology host the plan leaves idle)."""
    names = [h.name for h in plan.hosts]
    if args.atlas_host:
        topo.host(args.atlas_host)  # unknown name -> ValueError
        if args.node_rank not in (-1, *([names.index(args.atlas_host)] if args.atlas_host in names else [])):
            raise ValueError(f"--node_rank {args.node_rank} and --atlas-host {args.atlas_host!r} disagree: "
                             f"the plan's hostfile order is {names}")
        return args.atlas_host if args.atlas_host in names else None
    if args.node_rank >= 0:
        if args.node_rank >= len(names):
            raise ValueError(f"--node_rank {args.node_rank}: the plan uses {len(names)} hosts {names} "
                             "(the index is into the plan's hostfile)")
        return names[args.node_rank]
    name = socket.gethostname()
    if name in names:
        return name
    if name in [h.name for h in topo.hosts]:
        return None
    raise ValueError(f"--no_ssh needs --node_rank (index into the plan's hostfile {names}) or --atlas-host; "
                     f"this machine's host name {name!r} is not in the topology")
