"""The systems ATLAS is compared with, on the same topology, simulated by the same simulator.

Each baseline is modelled as the system behaves when launched on every host of the topology, and each
gets the best layout its own rules allow (the same branch-and-bound search by simulation as ATLAS):

``dp-wan``   Data parallelism across the WAN (PyTorch DDP / DeepSpeed ZeRO-0 over NCCL or gloo):
             each replica is a Megatron (pp, tp) pipeline inside one data center, replicas in two or
             more DCs, ranks ordered by DC; every stage's gradient all-reduce is a ring over all
             replicas whose WAN hops carry 2(D−1)/D of the gradients per direction, over one TCP
             connection per rank pair (NCCL's socket transport on a non-cloud NIC uses one data socket,
             gloo one connection per pair per context: atlas.md §2.1, §2.3), shared with TCP fairness.
``stock``    DeepSpeed's or Megatron's pipeline on the hostfile as given: global ranks in host order
             (atlas.md §3.1, §3.3), pipe the outermost axis (§3.4, §3.5), so stage s takes ranks
             [s·tp·dp, (s+1)·tp·dp) wherever they land: a stage's replicas, and a stage's DP group,
             may straddle data centers. All GPUs are used (world = every slot of the hostfile), layers
             split evenly (DeepSpeed's partition by parameters), one TCP connection per pair, spatial
             (plain TCP) sharing, pp and tp the best such layout.
``varuna``   Varuna-like (EuroSys'22, atlas.md §4): pipelines across data centers with data
             parallelism inside each DC — the stage-to-DC map of Algorithm 1 (whole stages, largest
             DC first), spanning two or more DCs — but stock transport: one TCP connection per pair,
             spatial sharing, layers split evenly, no tensor parallelism (Varuna uses only pipeline
             and data parallelism, for commodity networks). Any pp and dp it can place.

All baselines use the same per-connection window as ATLAS (the topology's ``window_mb`` or Linux's
default), the same costs (launch.plan.estimate) and the same 1F1B schedule; none of them has temporal
sharing or more than one connection per pair, which is what ATLAS adds.
"""

from __future__ import annotations

from collections.abc import Iterator
from math import gcd

from launch.plan.estimate import Layout, ModelSpec, stage_layers
from launch.plan.placement import place, usable_gpus
from launch.plan.topology import Topology

NAMES = {"dp-wan": "DP across the WAN", "stock": "DeepSpeed/Megatron stock", "varuna": "Varuna-like"}


def _degrees(model: ModelSpec, tps: list[int]) -> Iterator[tuple[int, int]]:
    """(tp, pp) pairs the model section allows."""
    for tp in [model.tp] if model.tp else tps:
        for pp in [model.pp] if model.pp else range(1, model.layers + 1):
            yield tp, pp


def _dps(model: ModelSpec) -> list[int]:
    seq = model.sequences
    return [model.dp] if model.dp else [d for d in range(1, seq + 1) if seq % d == 0]


def _divisors(n: int) -> list[int]:
    return [t for t in range(1, n + 1) if n % t == 0]


def dp_wan_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    max_slots = max(h.slots for h in topo.hosts)
    for tp, pp in _degrees(model, _divisors(max_slots)):
        cap = {d: usable_gpus(topo, d, tp) // (pp * tp) for d in topo.dc_names}
        holders = [d for d in topo.dc_names if cap[d]]
        if len(holders) < 2:
            continue
        for dp in _dps(model):
            if not 2 <= dp <= sum(cap.values()):
                continue
            counts = dict.fromkeys(holders, 0)
            left = dp
            while left:                      # one replica per DC in turn, as far as each holds
                for d in holders:
                    if left and counts[d] < cap[d]:
                        counts[d] += 1
                        left -= 1
            replicas = tuple(d for d in holders for _ in range(counts[d]))   # ranks ordered by DC
            yield Layout(tp, (replicas,) * pp, tuple(stage_layers(model.layers, pp)))


def stock_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    rank_dc = [h.dc for h in topo.hosts for _ in range(h.slots)]
    total = len(rank_dc)
    host_gcd = 0
    for h in topo.hosts:
        host_gcd = gcd(host_gcd, h.slots)
    for tp, pp in _degrees(model, _divisors(host_gcd)):     # a TP group never spans hosts
        if total % (pp * tp) or host_gcd % tp:
            continue
        dp = total // (pp * tp)
        if model.sequences % dp or (model.dp and model.dp != dp):
            continue
        dc = tuple(tuple(rank_dc[(s * dp + d) * tp] for d in range(dp)) for s in range(pp))
        yield Layout(tp, dc, tuple(stage_layers(model.layers, pp)))


def varuna_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    for _, pp in _degrees(model, [1]):
        if model.tp not in (None, 1):
            return
        for dp in _dps(model):
            stage_dc = place(topo, pp, 1, dp)
            if stage_dc is None or len(set(stage_dc)) < 2:
                continue
            yield Layout(1, tuple((d,) * dp for d in stage_dc), tuple(stage_layers(model.layers, pp)))


LAYOUTS = {"dp-wan": dp_wan_layouts, "stock": stock_layouts, "varuna": varuna_layouts}
