"""``deepspeed-atlas``: DeepSpeed's launcher with ATLAS's plan in front of it.

    deepspeed-atlas --atlas-topology configs/atlas_two_dc.json [--wan-connections N] [--atlas-sharing MODE] \\
        [every deepspeed runner argument] train.py [script arguments]

1. checks every input before anything runs, and stops with a ``ValueError`` message (exit status 2)
   that names the argument, file key or variable, its value and the rule: the topology (and model)
   file, host names and addresses in arguments, ports, the interface variables, the NCCL knobs, the
   timeout, ``.deepspeed_env`` files; then computes the plan (:mod:`launch.plan`);
2. writes the DC-ordered hostfile and passes it as ``--hostfile`` (global ranks follow hostfile order,
   so the stages land in their data centers), and ``--master_addr`` from the first host's ``addr``
   (a one-host plan runs here: 127.0.0.1 and no ssh check, as plain ``deepspeed`` does without one);
   ``--hostfile``, ``--include/--exclude`` (DeepSpeed's ``NAME[:SLOT,...]@...``), ``--num_nodes`` and
   ``--num_gpus`` select the hosts and slots the plan may use, before it is made, as ``deepspeed``
   applies them (what contradicts the topology is refused); every other runner option reaches the
   nodes or is refused with the reason (:data:`launch.run.launchers.REFUSED_OPTIONS`); script arguments
   are never abbreviation-matched;
3. sets ATLAS_*, NCCL_*, COMMWEAVE_TIMEOUT_S in the environment and hands over to DeepSpeed's own
   ``runner.main`` with the launcher subclasses of :mod:`launch.run.launchers`, which carry every value
   verbatim (pdsh quotes for the remote shell; MPI launchers and srun take arguments, not shell text).
   Single node and ``--no_ssh --node_rank`` children inherit the environment.

``--dry-run`` prints per node the exact command, environment and hostfile, and launches nothing
(:mod:`launch.run.dryrun`). ``--atlas-timeout S`` (else ``COMMWEAVE_TIMEOUT_S``, else the topology's
``timeout_s``) bounds every wait of the job's collectives.

With ``--no_ssh``, ``--node_rank`` is this host's index in the plan's hostfile (printed by
``python -m launch.plan``); ``--atlas-host NAME`` or the machine's host name find it instead. A host
the plan does not use exits at once with status 0, so the same command can run on every host.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import tempfile
import warnings
from collections.abc import Mapping
from contextlib import ExitStack, nullcontext, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

from commweave import values
from launch.net.sockets import nccl_env
from launch.plan import inputs, topology
from launch.plan.placement import (
    DEFAULT_SHARING,
    SHARINGS,
    UNVALIDATED,
    load_model,
    make_plan,
    render,
    sharing_modes,
)
from launch.plan.plan import Plan
from launch.plan.socket_limits import tcp_advice
from launch.run import launchers, runtime

EXPORT_PREFIXES = ["GLOO", "NCCL", "TORCH_GLOO", "ATLAS", "COMMWEAVE"]
TIMEOUT_ENV = "COMMWEAVE_TIMEOUT_S"
_OURS = {"--atlas-topology": True, "--atlas-model": True, "--wan-connections": True,
         "--atlas-sharing": True, "--link": True, "--atlas-host": True, "--atlas-hostfile": True,
         "--atlas-timeout": True,
         "--dry-run": False}
_NCCL_IFNAME = re.compile(r"[\^=]?[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}(,[A-Za-z0-9_][A-Za-z0-9_.-]{0,14})*",
                          re.ASCII)


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
    # no abbreviations: a script argument "--atlas" matched --atlas-topology/--atlas-model ("ambiguous
    # option") before the script's arguments were set aside
    parser.allow_abbrev = False
    g = parser.add_argument_group("ATLAS (training across data centers)")
    g.add_argument("--atlas-topology", required=True, metavar="FILE",
                   help="topology JSON: data centers, hosts and slots, WAN rtt_ms/bandwidth_gbps")
    g.add_argument("--atlas-model", metavar="FILE", help="model JSON (else the topology's \"model\")")
    g.add_argument("--wan-connections", type=int, default=None, metavar="N",
                   help="TCP connections per WAN pipeline pair (1..64; default: the planner chooses)")
    g.add_argument("--atlas-sharing", default=DEFAULT_SHARING, metavar="|".join(SHARINGS),
                   help="how DP replicas share a WAN link: at once (spatial, the default), taking turns "
                        f"(temporal), or the faster by the planner's simulator (auto); temporal and auto are "
                        f"{UNVALIDATED}")
    g.add_argument("--link", action="append", metavar="A:B=FILE",
                   help="the TCP window of the WAN link A-B as measured on it (FILE: python -m "
                        "benchmarks.wan --json FILE); repeat per link; else the topology's window_mb, else "
                        "Linux's default (as python -m launch.plan --link)")
    g.add_argument("--atlas-host", metavar="NAME", help="with --no_ssh: this host's name in the topology")
    g.add_argument("--atlas-hostfile", metavar="PATH", help="keep the generated hostfile at PATH")
    g.add_argument("--atlas-timeout", metavar="SECONDS",
                   help=f"bound on every collective wait of the job ({TIMEOUT_ENV}; default: the "
                        "variable, else the topology's timeout_s, else 300)")
    g.add_argument("--dry-run", action="store_true",
                   help="print per node the command, environment and hostfile; launch nothing")
    return parser


@dataclass
class Launch:
    plan: Plan
    text: str                 # the readable plan
    argv: list[str]           # for deepspeed's runner.main
    env: dict[str, str]       # set in this process before handing over
    hostfile: str             # where to write it ("" = a temporary file)
    advice: list[str]
    node: str | None = None   # --no_ssh: this host; None elsewhere
    idle: bool = False        # --no_ssh on a host the plan does not use
    launcher: str = "pdsh"
    hostfile_text: str = ""
    launcher_args: str = ""
    dry_run: bool = False


def prepare(argv: list[str], environ: Mapping[str, str] | None = None) -> Launch:
    """Everything that can fail, before anything launches."""
    environ = os.environ if environ is None else environ
    parser = deepspeed_parser()
    args = parser.parse_args(argv)
    script_at = len(argv) - len(args.user_args) - 1
    if argv[script_at] != args.user_script:
        raise ValueError(f"deepspeed-atlas: could not find the script {args.user_script!r} in the arguments")
    launcher = launchers.check_launcher(args.launcher)
    _check_arguments(args)
    _check_environment(environ)

    # a measured window replaces the stated or assumed one before anything is planned from it
    full, measured = inputs.apply_links(topology.load(args.atlas_topology), args.link)
    topo, slot_ids = _filter(full, args)
    model = load_model(topo, args.atlas_model)
    plan = make_plan(topo, model, args.wan_connections, args.atlas_sharing)
    env = {"ATLAS_WAN_CONNS": str(plan.connections), "ATLAS_SHARING": plan.sharing,
           "ATLAS_LAUNCHER": launcher}
    links = [topo.link(plan.stage_dc[s], plan.stage_dc[s + 1]) for s in plan.wan_boundaries()]
    if links:
        env.update(nccl_env(plan.connections, links, environ))
    env[runtime.ENV_PLAN] = plan.encode()
    if args.atlas_timeout is not None:
        env[TIMEOUT_ENV] = str(values.seconds(args.atlas_timeout, "--atlas-timeout", strings=True))
    elif TIMEOUT_ENV not in environ and topo.timeout_s is not None:
        env[TIMEOUT_ENV] = str(topo.timeout_s)

    head = _drop_ours(argv[:script_at])
    for flags in (("--include", "-i"), ("--exclude", "-e"), ("--hostfile", "-H"), ("--num_nodes",),
                  ("--num_gpus",)):
        head = _drop_option(head, *flags)     # applied to the plan: its hostfile and --include say it all
    extra = []
    one_host = len(plan.hosts) == 1 and not args.force_multi
    local = one_host or args.no_ssh
    launchers.check_options("local" if local else launcher, args, parser)
    master = args.master_addr or plan.hosts[0].addr or ("127.0.0.1" if one_host else None)
    if not args.master_addr and master:
        extra += ["--master_addr", master]
    if one_host and not args.no_ssh_check:
        extra.append("--no_ssh_check")   # DeepSpeed would ssh to the only host, this machine
    if not local:
        _check_launcher_fits(launcher, plan, master)
        if launcher in launchers.STARTS_SCRIPT:
            env.update(ATLAS_MASTER_ADDR=master, ATLAS_MASTER_PORT=str(args.master_port))
        _check_env_files(environ)
    launcher_args = args.launcher_args
    if launcher == "openmpi" and "btl_tcp_if_include" not in launcher_args and not local:
        ifnames = sorted({h.ifname for h in plan.hosts if h.ifname})
        if ifnames:   # DeepSpeed's default is eth0; MPI's own TCP traffic uses the DCs' interfaces
            launcher_args = f"{launcher_args} --mca btl_tcp_if_include {','.join(ifnames)}".strip()
            head = [*_drop_option(head, "--launcher_args"), "--launcher_args", launcher_args]

    include = _include(plan, slot_ids)
    if include and not local and launcher in launchers.NO_SLOT_IDS:
        raise ValueError(f"--include/--exclude select slots {include!r}: the {launcher} launcher cannot "
                         "pin ranks to slot ids (only the first slots of each host); select whole hosts "
                         "or the first slots, or use pdsh")
    if include:
        extra += ["--include", include]
    node = None
    if args.no_ssh:
        node = _this_node(plan, topo, args)
        if node is None:
            return Launch(plan, _text(plan, topo, model, measured), [], env, "", [], None, idle=True,
                          launcher=launcher)
        extra += ["--node_rank", str([h.name for h in plan.hosts].index(node))]
        head = _drop_option(head, "--node_rank")
        ifname = next(h.ifname for h in plan.hosts if h.name == node)
        if ifname:   # the data center's interface wins over a global default
            env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"] = ifname, f"={ifname}"
    hostfile_text = "".join(f"{h.name} slots={full.host(h.name).slots if include else h.slots}\n"
                            for h in plan.hosts)
    hostfile = args.atlas_hostfile or ""
    return Launch(plan, _text(plan, topo, model, measured),
                  head + extra + ["--hostfile", hostfile] + argv[script_at:],
                  env, hostfile, tcp_advice(links, plan.wan_flows), node, launcher=launcher,
                  hostfile_text=hostfile_text, launcher_args=launcher_args, dry_run=args.dry_run)


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

    from launch.run import dryrun

    with ExitStack() as stack:
        if launch.dry_run or not launch.hostfile:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="atlas-"))
            launch.hostfile = os.path.join(folder, "hostfile")
            launch.argv[launch.argv.index("--hostfile") + 1] = launch.hostfile
        Path(launch.hostfile).write_text(launch.hostfile_text)
        stack.enter_context(mock.patch.dict(os.environ, launch.env) if launch.dry_run else nullcontext())
        os.environ.update(launch.env)
        stack.enter_context(launchers.exported_prefixes(EXPORT_PREFIXES))
        plan = launch.plan
        per_node = plan.hosts[0].slots
        record: list = []
        stack.enter_context(launchers.atlas_runners(tuple(h.name for h in plan.hosts), per_node, record))
        if not launch.dry_run:
            try:
                runner.main(launch.argv)
            except ValueError as e:   # a value DeepSpeed's runner or ours refused at export time
                print(f"deepspeed-atlas: error: {e}", file=sys.stderr)
                sys.exit(2)
            return
        with dryrun.capture() as seen:
            runner.main(launch.argv)
        seen.runners = record
        print(dryrun.report(seen, launch, launch.hostfile), flush=True)


def _check_arguments(args) -> None:
    """Host names, addresses, ports, the timeout and the sharing mode given on the command line:
    commweave.values' rules."""
    for name in ("master_port", "ssh_port"):
        if getattr(args, name) is not None:
            values.port(getattr(args, name), f"--{name}")
    if args.master_addr:
        values.address(args.master_addr, "--master_addr")
    if args.atlas_host is not None:
        values.host_name(args.atlas_host, "--atlas-host")
    if args.atlas_timeout is not None:
        values.seconds(args.atlas_timeout, "--atlas-timeout", strings=True)
    sharing_modes(args.atlas_sharing, "--atlas-sharing")


# Integer knobs exported to the nodes that NCCL reads (NCCL takes -1 or garbage for its default or worse:
# NCCL_BUFFSIZE=-1 reached every node); the ranges are NCCL's own limits or what a node can allocate.
NCCL_INTEGERS = {"NCCL_BUFFSIZE": (4096, 2**30, "bytes per channel buffer"),
                 "NCCL_SOCKET_NTHREADS": (1, 16, "threads"), "NCCL_NSOCKS_PERTHREAD": (1, 64, "sockets"),
                 "NCCL_MIN_NCHANNELS": (1, 64, "channels"), "NCCL_MAX_NCHANNELS": (1, 64, "channels"),
                 "NCCL_NTHREADS": (64, 512, "threads"), "NCCL_P2P_NET_CHUNKSIZE": (1024, 2**30, "bytes")}


def _check_environment(environ: Mapping[str, str]) -> None:
    """Variables this launcher reads or exports: interface lists, NCCL's integer knobs, the timeout,
    exported names."""
    from deepspeed.launcher import runner

    gloo = environ.get("GLOO_SOCKET_IFNAME")
    if gloo is not None:
        for part in gloo.split(","):
            values.ifname(part, f"GLOO_SOCKET_IFNAME={gloo!r}: entry")
    nccl = environ.get("NCCL_SOCKET_IFNAME")
    if nccl is not None and not _NCCL_IFNAME.fullmatch(nccl):
        values.refuse("NCCL_SOCKET_IFNAME", nccl, "must be interface names or prefixes separated by ',' with "
                      f"an optional leading '^' (exclude) or '=' (exact); each "
                      f"{values.IFNAME_RULE.removeprefix('must be ')}")
    for key, (lo, hi, unit) in NCCL_INTEGERS.items():
        if key in environ:
            values.integer(environ[key], key, lo=lo, hi=hi, unit=unit, strings=True)
    if TIMEOUT_ENV in environ:
        values.seconds(environ[TIMEOUT_ENV], TIMEOUT_ENV, strings=True)
    if "ATLAS_HOST" in environ:
        values.host_name(environ["ATLAS_HOST"], "ATLAS_HOST")
    prefixes = tuple(EXPORT_PREFIXES + runner.EXPORT_ENVS)
    for key in environ:
        if key.startswith(prefixes):
            launchers.check_env_name(key)


def _check_env_files(environ: Mapping[str, str]) -> None:
    """DeepSpeed exports every ``KEY=VALUE`` line of ``~/.deepspeed_env`` and ``./.deepspeed_env`` (the
    name from DS_ENV_FILE) on the multi-node path and fails on a line without ``=`` (a blank line)."""
    from deepspeed.launcher import runner

    for folder in runner.DEEPSPEED_ENVIRONMENT_PATHS:
        path = Path(folder, runner.DEEPSPEED_ENVIRONMENT_NAME)
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text().splitlines(keepends=True), 1):
            if "=" not in line:
                raise ValueError(f"{path}: line {n} {line!r} is not KEY=VALUE (DeepSpeed's runner stops "
                                 "on it; remove blank and comment lines)")
            launchers.check_env_name(line.split("=", 1)[0])


def _check_launcher_fits(launcher: str, plan: Plan, master: str | None) -> None:
    slots = {h.name: h.slots for h in plan.hosts}
    if launcher in launchers.UNIFORM_SLOTS and len(set(slots.values())) > 1:
        raise ValueError(f"--launcher {launcher}: it starts the same number of ranks on every host, but "
                         f"the plan uses {slots}; give the hosts equal slots (topology or --include) or "
                         "use pdsh or openmpi")
    if launcher in launchers.STARTS_SCRIPT and not master:
        raise ValueError(f"--launcher {launcher}: the ranks need MASTER_ADDR, which DeepSpeed finds by "
                         f"ssh only on pdsh; give host {plan.hosts[0].name!r} an \"addr\" in the topology "
                         "or pass --master_addr")


def _filter(topo: topology.Topology, args):
    """The topology cut down to the hosts and slots that ``--hostfile``, ``--include``/``--exclude`` and
    ``--num_nodes``/``--num_gpus`` select, as DeepSpeed applies them (its own functions, in its order:
    the hostfile, the filter, then the first N hosts and the first N slots of each), and the selected
    slot ids per host; what contradicts the topology is refused naming both."""
    from deepspeed.launcher import runner

    pool = {h.name: list(range(h.slots)) for h in topo.hosts}
    if args.hostfile != runner.DLTS_HOSTFILE:
        pool = _hostfile_pool(topo, args.hostfile)
    for name in ("num_nodes", "num_gpus"):
        n = getattr(args, name)
        if n != -1:
            values.integer(n, f"--{name}", lo=1, hi=topology.MAX_HOSTS * topology.MAX_SLOTS)
            if args.include or args.exclude:   # DeepSpeed's own rule
                raise ValueError(f"--{name} {n}: cannot be combined with --include/--exclude "
                                 "(as in deepspeed)")
    if args.num_nodes > len(pool):
        offer = "--hostfile offers" if args.hostfile != runner.DLTS_HOSTFILE else f"{topo.source} offers"
        raise ValueError(f"--num_nodes {args.num_nodes}: {offer} {len(pool)} hosts {list(pool)}")
    if args.num_gpus != -1:
        hosts = list(pool)[:args.num_nodes] if args.num_nodes > 0 else list(pool)
        short = {h: len(pool[h]) for h in hosts if len(pool[h]) < args.num_gpus}
        if short:
            raise ValueError(f"--num_gpus {args.num_gpus}: more than these hosts offer in {topo.source}: "
                             f"{short}")
    chosen = pool
    if args.include or args.exclude:
        flag = f"--include {args.include!r}" if args.include else f"--exclude {args.exclude!r}"
        try:
            chosen = runner.parse_resource_filter(pool, include_str=args.include, exclude_str=args.exclude)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{flag}: {e} (hosts and slots of {topo.source}: "
                             f"{ {h: len(s) for h, s in pool.items()} })") from None
    chosen = runner.apply_num_nodes_and_gpus(chosen, args.num_nodes, args.num_gpus)
    if chosen == {h.name: list(range(h.slots)) for h in topo.hosts}:
        return topo, chosen
    dcs = []
    for dc in topo.datacenters:
        hosts = tuple(replace(h, slots=len(chosen[h.name])) for h in dc.hosts if chosen.get(h.name))
        if hosts:
            dcs.append(replace(dc, hosts=hosts))
    if not dcs:
        raise ValueError(f"--include/--exclude/--hostfile: selects no slot of {topo.source}")
    names = {d.name for d in dcs}
    wan = tuple(w for w in topo.wan if {w.a, w.b} <= names)
    return replace(topo, datacenters=tuple(dcs), wan=wan), chosen


def _hostfile_pool(topo: topology.Topology, path: str) -> dict[str, list[int]]:
    """``--hostfile``: DeepSpeed's parser on the file; every host must be the topology's, with no more
    slots than it has there."""
    from deepspeed.launcher import runner

    values.regular_file(path, "--hostfile")
    try:
        lines = Path(path).read_text().splitlines()
        parsed = runner._parse_hostfile(lines)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--hostfile {path!r}: {e}") from None
    known = {h.name: h.slots for h in topo.hosts}
    for name, slots in parsed.items():
        if name not in known:
            raise ValueError(f"--hostfile {path!r}: host {name!r} is not in {topo.source} "
                             f"(its hosts: {list(known)})")
        if slots > known[name]:
            raise ValueError(f"--hostfile {path!r}: {name} slots={slots}, but {topo.source} gives it "
                             f"{known[name]}")
    return {name: list(range(slots)) for name, slots in parsed.items()}


def _include(plan: Plan, slot_ids: dict[str, list[int]]) -> str:
    """DeepSpeed's ``--include`` for the plan's slots, or "" when each host uses its first slots."""
    picks = {h.name: slot_ids[h.name][:h.slots] for h in plan.hosts}
    if all(ids == list(range(len(ids))) for ids in picks.values()):
        return ""
    return "@".join(f"{name}:{','.join(map(str, ids))}" for name, ids in picks.items())


def _text(plan: Plan, topo: topology.Topology, model, measured: inputs.Measured) -> str:
    """The plan as printed, with where each WAN window came from (launch.plan.inputs)."""
    return "\n".join([render(plan, topo, model), *inputs.render(topo, measured)])


def _drop_ours(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
            continue
        if tok in _OURS:
            skip = _OURS[tok]
            continue
        if any(tok.startswith(opt + "=") for opt in _OURS):
            continue
        out.append(tok)
    return out


def _drop_option(tokens: list[str], *options: str) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in options:
            skip = True
        elif not any(tok.startswith(o + "=") for o in options):
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
