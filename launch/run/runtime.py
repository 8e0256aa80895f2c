"""What a training script calls on every rank to follow the plan ``deepspeed-atlas`` exported.

    import launch.run.runtime as atlas
    plan = atlas.init()                          # before deepspeed.init_distributed()
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers, topology=atlas.pipe_topology(plan), ...)
    engine, *_ = deepspeed.initialize(model=model, ...)
    wan = atlas.enable_deepspeed(plan)           # multi-TCP striping + temporal sharing; wan.undo()

Megatron: ``atlas.init()`` before ``torch.distributed.init_process_group``, then
``initialize_model_parallel(tp, pp, nccl_communicator_config_path=atlas.megatron_nccl_config(plan))``
(default order, pipe outermost) and ``atlas.enable_megatron(plan)`` on gloo.

The launcher exports (every value is safe to quote, the plan is URL-safe base64):
``ATLAS_PLAN`` (the plan), ``ATLAS_WAN_CONNS`` (connections per WAN pair), ``ATLAS_SHARING``
(temporal | spatial), ``ATLAS_LAUNCHER`` (which launcher started the ranks), ``COMMWEAVE_TIMEOUT_S``
(the bound on every collective wait) and the NCCL_* knobs of :mod:`launch.net.sockets`. Per-node
settings cannot be exported (the export is the same on every node), so :func:`init` resolves them
in the rank.
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings
from typing import TYPE_CHECKING

from launch.net.sockets import megatron_nccl_config as _nccl_yaml
from launch.plan.plan import Plan
from launch.plan.socket_limits import tcp_advice
from launch.plan.topology import WanLink

if TYPE_CHECKING:     # torch is imported only where a process group is used, not by init()
    from launch.net.wan_p2p import WanP2P

ENV_PLAN, ENV_CONNS, ENV_SHARING, ENV_HOST = "ATLAS_PLAN", "ATLAS_WAN_CONNS", "ATLAS_SHARING", "ATLAS_HOST"
ENV_LAUNCHER = "ATLAS_LAUNCHER"
# Each launcher's own local-rank variable (launch.run.launchers): DeepSpeed's launch (pdsh, --no_ssh,
# one node), DeepSpeed's launcher_helper (mpich) and impi's -env set LOCAL_RANK themselves.
LAUNCHER_VARIABLES = {"pdsh": ("LOCAL_RANK",), "openmpi": ("OMPI_COMM_WORLD_LOCAL_RANK",),
                      "slurm": ("SLURM_LOCALID",), "mpich": ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"),
                      "impi": ("LOCAL_RANK",)}
_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID",
               "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_WORLD_VARS = ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def current_plan() -> Plan | None:
    """The plan the launcher exported, or None outside ``deepspeed-atlas``."""
    text = os.environ.get(ENV_PLAN)
    if not text:
        return None
    try:
        return Plan.decode(text)
    except Exception as e:  # a truncated or foreign value: say which variable, not a decode trace
        raise ValueError(f"{ENV_PLAN} does not hold an ATLAS plan ({type(e).__name__}: {e})") from None


def init(plan: Plan | None = None) -> Plan | None:
    """Per-rank set-up before the process group exists.

    - Finds this process's host in the plan and its local index there, from the launcher that
      started it (``ATLAS_LAUNCHER``, exported by deepspeed-atlas; :data:`LAUNCHER_VARIABLES`):
      ``ATLAS_HOST``, else DeepSpeed's node index ``CROSS_RANK`` (pdsh, ``--no_ssh``, one node: the
      hostfile is the plan's order, so RANK is already right and is checked), else Slurm's
      ``SLURMD_NODENAME``, else the rank an MPI launcher gives (``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``;
      they keep the hostfile's order), else the machine's host name. The local index comes from
      ``LOCAL_RANK`` or the launcher's own variable; with none of them on a host that runs several
      ranks, this raises rather than assume local rank 0.
    - Sets ``RANK`` (the plan's rank of (host, local index)), ``LOCAL_RANK``, ``WORLD_SIZE`` and, where
      the launcher did not, ``MASTER_ADDR``/``MASTER_PORT`` from ``ATLAS_MASTER_ADDR``/``_PORT``: what
      ``init_process_group``'s ``env://`` and DeepSpeed read.
    - Interfaces: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` from the host's data center ``ifname``,
      which wins over a value exported to every node (interfaces differ per DC); a data center
      without ``ifname`` keeps the variable as it came.
    - Warns where this host's TCP sysctls would keep the WAN connections from filling the link.
    """
    plan = plan or current_plan()
    if plan is None:
        return None
    env = os.environ
    launcher = env.get(ENV_LAUNCHER)
    if launcher is not None and launcher not in LAUNCHER_VARIABLES:
        raise ValueError(f"{ENV_LAUNCHER}={launcher!r}: not a launcher ATLAS adapts "
                         f"({', '.join(LAUNCHER_VARIABLES)})")
    world = _first(env, ("WORLD_SIZE", *_WORLD_VARS))
    if world is not None and world[1] != str(plan.world_size):
        raise ValueError(f"{world[0]}={world[1]} but the ATLAS plan has {plan.world_size} ranks "
                         f"(pp={plan.pp} x tp={plan.tp} x dp={plan.dp})")
    host, keep_rank = _my_host(plan, launcher)
    if host is not None:
        slots = next(h.slots for h in plan.hosts if h.name == host)
        first = plan.rank_of(host, 0)
        local = _local_rank(env, launcher, host, slots, required=keep_rank is None)
        if keep_rank is not None:
            if not first <= keep_rank < first + slots:
                raise ValueError(f"RANK={keep_rank} on node {host}, but the plan gives that host ranks "
                                 f"{first}..{first + slots - 1}: launch with deepspeed-atlas's hostfile")
            if local is not None and keep_rank - first != local:
                raise ValueError(f"rank {keep_rank} is local rank {local} on {host}, but the plan puts it "
                                 f"at local index {keep_rank - first}: launch with deepspeed-atlas's "
                                 "hostfile and the launcher's default block placement")
            local = keep_rank - first
        env["RANK"], env["LOCAL_RANK"] = str(plan.rank_of(host, local)), str(local)
        env["WORLD_SIZE"] = str(plan.world_size)
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in env and f"ATLAS_{var}" in env:
                env[var] = env[f"ATLAS_{var}"]
        ifname = next(h.ifname for h in plan.hosts if h.name == host)
        if ifname:
            env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"] = ifname, f"={ifname}"
    for warning in _advice(plan):
        warnings.warn(f"ATLAS: {warning}", RuntimeWarning, stacklevel=2)
    return plan


def pipe_topology(plan: Plan):
    """DeepSpeed's topology for the plan: pipe outermost, so stage s is ranks [s·tp·dp, (s+1)·tp·dp)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=plan.pp, num_mp=plan.tp, num_dp=plan.dp)


def enable_deepspeed(plan: Plan | None = None, connections: int | None = None, sharing: str | None = None,
                     ifname: str | None = None) -> WanP2P:
    """Route DeepSpeed's WAN pipeline sends over k-connection gloo groups with temporal sharing.

    Call on every rank after ``deepspeed.initialize`` returned a PipelineEngine (collective: it
    creates process groups). Returns the handle whose ``undo()`` restores DeepSpeed's p2p.
    """

    def check(plan: Plan) -> None:
        from deepspeed.runtime.pipe import p2p

        from launch.net.wan_p2p import DEEPSPEED_PARAMS, Patch

        grid = p2p._grid
        if grid is None:
            raise RuntimeError("enable_deepspeed: call it after deepspeed.initialize() built the "
                               "PipelineEngine")
        topo = grid.topology()
        for r in range(plan.world_size):
            c = topo.get_coord(r)
            if (c.pipe, c.data, getattr(c, "model", 0)) != plan.coord(r):
                raise ValueError(f"enable_deepspeed: the PipelineModule's topology puts rank {r} at {c}, the "
                                 f"plan at (stage, data, model) {plan.coord(r)}: build the model with "
                                 "topology=launch.run.runtime.pipe_topology(plan)")
        for name, params in DEEPSPEED_PARAMS.items():
            Patch.check(p2p, name, params)

    wan = _wan_p2p(plan, connections, sharing, ifname, check)
    wan.patch_deepspeed()
    return wan


def enable_megatron(plan: Plan | None = None, connections: int | None = None, sharing: str | None = None,
                    ifname: str | None = None) -> WanP2P:
    """The same for Megatron-core's pipeline p2p (``_p2p_ops`` and ``_batched_p2p_ops``), which its
    schedules (``forward_backward_pipelining_without_interleaving`` and the interleaved one) call
    through ``P2PCommunicator``."""

    def check(plan: Plan) -> None:
        from megatron.core.pipeline_parallel import p2p_communication as mp

        from launch.net.wan_p2p import MEGATRON_PARAMS, Patch

        for name in ("_p2p_ops", "_batched_p2p_ops"):
            Patch.check(mp, name, MEGATRON_PARAMS)

    wan = _wan_p2p(plan, connections, sharing, ifname, check)
    wan.patch_megatron()
    return wan


def megatron_nccl_config(plan: Plan, directory: str | None = None) -> str | None:
    """Path of a YAML for ``nccl_communicator_config_path`` putting the WAN groups on NCCL's socket
    transport (where NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS act); None when nothing crosses."""
    text = _nccl_yaml(bool(plan.wan_boundaries()))
    if not text:
        return None
    fd, path = tempfile.mkstemp(prefix="atlas-nccl-", suffix=".yaml", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _settings(plan, connections, sharing) -> tuple[Plan, int, str]:
    plan = plan or current_plan()
    if plan is None:
        raise ValueError(f"no ATLAS plan: launch with deepspeed-atlas (it exports {ENV_PLAN}) or pass one")
    if connections is None:
        text = os.environ.get(ENV_CONNS, str(plan.connections))
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{ENV_CONNS}={text!r}: must be a positive integer")
        connections = int(text)
    sharing = sharing or os.environ.get(ENV_SHARING, plan.sharing)
    if sharing not in ("temporal", "spatial"):
        raise ValueError(f"{ENV_SHARING}={sharing!r}: use 'temporal' or 'spatial'")
    return plan, connections, sharing


def _wan_p2p(plan, connections, sharing, ifname: str | None, check) -> WanP2P:
    """Check everything that can fail on this rank, agree with every rank that nothing did (one
    all-gather), then create the groups (collective) and return the unpatched handle."""
    from commweave import comm
    from launch.net.recovery import retries
    from launch.net.sharing import TemporalSharing
    from launch.net.striping import open_wan_groups, wan_devices
    from launch.net.wan_p2p import WanP2P

    problem, devices = None, ""
    try:
        plan, connections, sharing = _settings(plan, connections, sharing)
        devices = wan_devices(plan, connections, ifname)
        retries()
        comm.timeout_s()
        check(plan)
    except (ValueError, RuntimeError) as e:
        problem = e
    _agree_before_setup(plan, connections, sharing, problem)
    wan = open_wan_groups(plan, connections, devices=devices)
    return WanP2P(wan, TemporalSharing(plan) if sharing == "temporal" else None, plan=plan)


def _agree_before_setup(plan, connections, sharing, problem: Exception | None) -> None:
    """Raise on every rank, before any group exists, if any rank could not set up or the ranks were
    given different plans, connection counts or sharing modes (one all-gather of 4 integers)."""
    import zlib

    import torch
    import torch.distributed as dist

    from commweave import comm

    if not dist.is_initialized():
        raise problem or RuntimeError("ATLAS: torch.distributed is not initialised (call it after "
                                      "init_process_group / deepspeed.init_distributed)")
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    fingerprint = zlib.crc32(plan.encode().encode()) if isinstance(plan, Plan) else 0
    conns = connections if isinstance(connections, int) else 0
    mode = {"temporal": 1, "spatial": 2}.get(sharing, 0)
    failed = int(problem is not None)
    mine = torch.tensor([failed, fingerprint, conns, mode], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(), 4, dtype=torch.int64, device=device)
    comm.all_gather(every, mine, dist.group.WORLD)
    every = every.cpu()
    failed = [r for r in range(len(every)) if every[r, 0]]
    if failed:
        here = f"; on this rank: {problem}" if problem is not None else "; see the error on those ranks"
        raise ValueError(f"ATLAS set-up stopped on every rank before creating any group: rank(s) {failed} "
                         f"could not set up{here}") from problem
    for col, what in ((1, f"the plan ({ENV_PLAN})"), (2, f"the connections per WAN pair ({ENV_CONNS})"),
                      (3, f"the sharing mode ({ENV_SHARING})")):
        if (every[:, col] != every[0, col]).any():
            values = ", ".join(f"rank {r}: {int(every[r, col])}" for r in range(len(every)))
            raise ValueError(f"ATLAS set-up: the ranks disagree on {what} ({values}); every rank must get "
                             "the same (deepspeed-atlas exports one value to all)")


def _first(env, names) -> tuple[str, str] | None:
    for name in names:
        if env.get(name) not in (None, ""):
            return name, env[name]
    return None


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: must be an integer") from None


def _local_rank(env, launcher: str | None, host: str, slots: int, required: bool) -> int | None:
    """This process's index on its host, from LOCAL_RANK or the launcher's variable. Without one: 0
    on a host that runs one rank (by necessity, not by assumption), None where the launcher's global
    rank already places the process (``required`` False), else a ValueError."""
    names = ("LOCAL_RANK", *LAUNCHER_VARIABLES.get(launcher, _LOCAL_VARS))
    if launcher in LAUNCHER_VARIABLES and launcher not in ("pdsh", "mpich", "impi"):
        names = (*LAUNCHER_VARIABLES[launcher], "LOCAL_RANK")   # the launcher's own count wins
    found = _first(env, names)
    if found is None:
        if slots == 1:
            return 0
        if not required:
            return None
        raise ValueError(f"no local rank for this process on {host}, which runs {slots} ranks: none of "
                         f"{', '.join(dict.fromkeys(names))} is set (launcher {launcher or 'unknown'}); "
                         "ATLAS does not assume local rank 0")
    local = _int(*found)
    if not 0 <= local < slots:
        raise ValueError(f"{found[0]}={local}: host {host} runs {slots} ranks in the plan")
    return local


def _my_host(plan: Plan, launcher: str | None) -> tuple[str | None, int | None]:
    """(this process's host in the plan, the global rank the launcher gave it where that rank already
    follows the plan's order and must be kept, else None)."""
    names = [h.name for h in plan.hosts]
    env = os.environ
    if env.get(ENV_HOST):
        host = env[ENV_HOST]
        if host not in names:
            raise ValueError(f"{ENV_HOST}={host!r} is not a host of the plan: {names}")
        return host, None
    if env.get("CROSS_RANK") is not None:
        node = _int("CROSS_RANK", env["CROSS_RANK"])
        if not 0 <= node < len(names):
            raise ValueError(f"CROSS_RANK={node}: the plan has {len(names)} hosts {names}")
        return names[node], _int("RANK", env["RANK"]) if "RANK" in env else None
    if env.get("SLURMD_NODENAME"):
        host = env["SLURMD_NODENAME"]
        if host not in names:
            raise ValueError(f"SLURMD_NODENAME={host!r} (Slurm's name for this node) is not a host of the "
                             f"plan {names}: the topology must name hosts as Slurm does")
        return host, None
    mpi = _first(env, _MPI_RANK_VARS)
    if mpi is not None:
        rank = _int(*mpi)
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"{mpi[0]}={rank}: the plan has {plan.world_size} ranks")
        return plan.host_of(rank)[0].name, rank
    name = socket.gethostname()
    return (name, None) if name in names else (None, None)


def _advice(plan: Plan) -> list[str]:
    return tcp_advice([WanLink(*w) for w in plan.wan_links], plan.wan_flows)
