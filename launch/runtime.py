"""What a training script calls on every rank to follow the plan ``deepspeed-atlas`` exported.

    import launch.runtime as atlas
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
(temporal | spatial), and the NCCL_* knobs of :mod:`launch.sockets`. Per-node settings cannot be
exported (the export is the same on every node), so :func:`init` resolves them in the rank.
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings

from launch.plan import Plan
from launch.sharing import TemporalSharing
from launch.sockets import megatron_nccl_config as _nccl_yaml
from launch.sockets import tcp_advice
from launch.striping import open_wan_groups
from launch.topology import WanLink
from launch.wan_p2p import WanP2P

ENV_PLAN, ENV_CONNS, ENV_SHARING, ENV_HOST = "ATLAS_PLAN", "ATLAS_WAN_CONNS", "ATLAS_SHARING", "ATLAS_HOST"


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

    - Finds this process's host in the plan: ``ATLAS_HOST``, else DeepSpeed's node index
      (``CROSS_RANK``: deepspeed-atlas's hostfile is the plan's order, so RANK is already right),
      else the machine's host name.
    - RANK remap: a process found by ``ATLAS_HOST`` or host name gets ``RANK`` = the plan's rank of
      (host, LOCAL_RANK). This covers launchers that order hosts their own way (Slurm, torchrun with
      another node order) and Megatron, whose rank generator has no hook for a custom rank order.
    - Interfaces: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` from the host's data center
      ``ifname`` unless already set (interfaces differ per DC, so this cannot ride on the export).
    - Warns where this host's TCP sysctls would keep the WAN connections from filling the link.
    """
    plan = plan or current_plan()
    if plan is None:
        return None
    if os.environ.get("WORLD_SIZE") not in (None, str(plan.world_size)):
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but the ATLAS plan has {plan.world_size} "
                         f"ranks (pp={plan.pp} x tp={plan.tp} x dp={plan.dp})")
    host, by_node_index = _my_host(plan)
    if host is not None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        first, slots = plan.rank_of(host, 0), next(h.slots for h in plan.hosts if h.name == host)
        if not by_node_index:
            os.environ["RANK"] = str(plan.rank_of(host, local))
        elif not first <= int(os.environ.get("RANK", first)) < first + slots:
            raise ValueError(f"RANK={os.environ['RANK']} on node {host} (CROSS_RANK="
                             f"{os.environ['CROSS_RANK']}), but the plan gives that host ranks "
                             f"{first}..{first + slots - 1}: launch with deepspeed-atlas's hostfile")
        ifname = next(h.ifname for h in plan.hosts if h.name == host)
        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", f"={ifname}")
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
    from deepspeed.runtime.pipe import p2p

    plan, connections, sharing = _settings(plan, connections, sharing)
    grid = p2p._grid
    if grid is None:
        raise RuntimeError("enable_deepspeed: call it after deepspeed.initialize() built the PipelineEngine")
    topo = grid.topology()
    for r in range(plan.world_size):
        c = topo.get_coord(r)
        if (c.pipe, c.data, getattr(c, "model", 0)) != plan.coord(r):
            raise ValueError(f"enable_deepspeed: the PipelineModule's topology puts rank {r} at {c}, the "
                             f"plan at (stage, data, model) {plan.coord(r)}: build the model with "
                             "topology=launch.runtime.pipe_topology(plan)")
    wan = _wan_p2p(plan, connections, sharing, ifname)
    wan.patch_deepspeed()
    return wan


def enable_megatron(plan: Plan | None = None, connections: int | None = None, sharing: str | None = None,
                    ifname: str | None = None) -> WanP2P:
    """The same for Megatron-core's pipeline p2p (``_p2p_ops`` and ``_batched_p2p_ops``)."""
    plan, connections, sharing = _settings(plan, connections, sharing)
    wan = _wan_p2p(plan, connections, sharing, ifname)
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
    connections = connections or int(os.environ.get(ENV_CONNS, plan.connections))
    sharing = sharing or os.environ.get(ENV_SHARING, plan.sharing)
    if sharing not in ("temporal", "spatial"):
        raise ValueError(f"{ENV_SHARING}={sharing!r}: use 'temporal' or 'spatial'")
    return plan, connections, sharing


def _wan_p2p(plan: Plan, connections: int, sharing: str, ifname: str | None) -> WanP2P:
    wan = open_wan_groups(plan, connections, ifname)
    return WanP2P(wan, TemporalSharing(plan) if sharing == "temporal" else None)


def _my_host(plan: Plan) -> tuple[str | None, bool]:
    """(this process's host in the plan, whether it was found by DeepSpeed's node index)."""
    names = [h.name for h in plan.hosts]
    if os.environ.get(ENV_HOST):
        host = os.environ[ENV_HOST]
        if host not in names:
            raise ValueError(f"{ENV_HOST}={host!r} is not a host of the plan: {names}")
        return host, False
    if os.environ.get("CROSS_RANK") is not None:
        node = int(os.environ["CROSS_RANK"])
        if not 0 <= node < len(names):
            raise ValueError(f"CROSS_RANK={node}: the plan has {len(names)} hosts {names}")
        return names[node], True
    name = socket.gethostname()
    return (name, False) if name in names else (None, False)


def _advice(plan: Plan) -> list[str]:
    return tcp_advice([WanLink(*w) for w in plan.wan_links], plan.connections)
