"""The systems ATLAS is compared with, on the same topology, simulated by the same simulator, each with
the same freedom ATLAS takes: any subset of the GPUs and data centers its own system can be launched on
(pp·tp·dp <= the GPUs offered, e.g. all inside one DC), its best pp/tp/dp, and the layer split its own
system can express. Where a baseline is held back, it is by a limit of the real system (:data:`LIMITS`,
printed with the table), never by the comparison:

``deepspeed``  DeepSpeed's PipelineModule on a hostfile the user writes: any data centers, listed in any
               order, each DC's hosts in file order; the job takes the first pp·tp·dp slots (a TP group
               never spans hosts). Global ranks follow the hostfile and pipe is the outermost axis, so
               stage s takes ranks [s·tp·dp, (s+1)·tp·dp) wherever they land: a stage may straddle data
               centers. Layers: ``partition_method`` 'parameters' (the default) or 'uniform'; with equal
               transformer layers both give ``partition_uniform``'s split, the extra layers first.
``megatron``   Megatron-LM on the same hostfiles, with ``--decoder-first-pipeline-num-layers`` /
               ``--decoder-last-pipeline-num-layers``: the first and last stage take any number of layers,
               the middle stages an equal share of the rest (megatron-core asserts it divides). Of those
               splits the one with the smallest max(layers_s / speed_s) (the speed of a stage: its
               slowest replica's GPU), the rule ATLAS's own split uses.
``varuna``     Varuna-like (EuroSys'22, atlas.md §4): whole stages per data center (the same placements
               as ATLAS, one DC included), data parallelism inside each DC, layers split evenly (cut-
               points, homogeneous GPUs assumed), no tensor parallelism (Varuna uses only pipeline and
               data parallelism, for commodity networks).
``dp-wan``     Data parallelism (PyTorch DDP / DeepSpeed ZeRO-0 over NCCL or gloo) of Megatron (pp, tp)
               pipelines, each replica inside one DC, replicas over any non-empty set of DCs (dealt one
               per DC in turn, ranks ordered by DC): every stage's gradient all-reduce is a ring whose WAN
               hops carry 2(D−1)/D of the gradients per direction (atlas.md §2.1, §2.3). Even layers.

All of them: one TCP connection per rank pair (NCCL's socket transport on a non-cloud NIC and gloo's
defaults, atlas.md §2.1) and spatial sharing (plain TCP fairness: no system but ATLAS takes turns on a WAN
link), the same per-connection window as ATLAS (the topology's ``window_mb`` or Linux's default), the
same costs (launch.plan.estimate), and the call order of the engine each really runs (:data:`SCHEDULES`,
the blocking executor of launch.plan.deepspeed_schedule): DeepSpeed's TrainSchedule for DeepSpeed,
Megatron's non-interleaved 1F1B for Megatron-LM and the DP-across-the-WAN pipelines. Varuna's own
schedule (opportunistic 1F1B with recomputation) is not modelled: Megatron's 1F1B calls stand in for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import permutations
from math import gcd

from launch.plan.estimate import Layout, ModelSpec, nccl_memory, stage_layers
from launch.plan.placement import degrees, placements, usable_gpus
from launch.plan.topology import Topology

NAMES = {"deepspeed": "DeepSpeed", "megatron": "Megatron-LM", "varuna": "Varuna-like",
         "dp-wan": "DP across the WAN"}
LIMITS = {
    "deepspeed": "1 TCP connection, spatial sharing; layers by parameters (= uniform)",
    "megatron": "1 TCP connection, spatial sharing; uneven first/last stage only",
    "varuna": "1 TCP connection, spatial sharing; even layers; no TP (Varuna: PP + DP only)",
    "dp-wan": "1 TCP connection, spatial sharing; even layers; gradients over the WAN",
}
SCHEDULES = {"deepspeed": "deepspeed", "megatron": "megatron", "varuna": "megatron", "dp-wan": "megatron"}
# hostfile orders tried: every order of every subset of the DCs up to this many DCs, else file order
_ORDERED_DCS = 4


def even_split(layers: int, speeds: list[float], caps: list[int]) -> list[int] | None:
    """DeepSpeed's partition_method 'uniform' (and 'parameters' on equal layers): the extra layers on the
    first stages, whatever the GPUs' speeds; None when a stage would exceed its memory cap."""
    n = stage_layers(layers, len(speeds))
    return n if len(speeds) <= layers and all(k <= c for k, c in zip(n, caps, strict=True)) else None


def megatron_split(layers: int, speeds: list[float], caps: list[int]) -> list[int] | None:
    """Megatron-LM's uneven first/last stage: [f, m, ..., m, l] with f + (pp−2)·m + l = layers, the one with
    the smallest max(n_s / v_s) within the caps (ties: the smallest sum of (n_s / v_s)², the most even)."""
    pp = len(speeds)
    if pp > layers:
        return None
    if pp == 1:
        return [layers] if layers <= caps[0] else None
    v0, vl, mid = speeds[0], speeds[-1], speeds[1:-1]
    best, best_t, best_spread = None, float("inf"), float("inf")
    for m in range(1, (layers - 2) // (pp - 2) + 1) if pp > 2 else [0]:
        if mid and (m > min(caps[1:-1])):
            break
        r = layers - m * (pp - 2)               # for the first and the last stage
        t_mid = max((m / v for v in mid), default=0.0)
        f_star = r * v0 / (v0 + vl)             # f / v0 = (r − f) / vl
        for f in (int(f_star), int(f_star) + 1):
            f = min(max(f, max(1, r - caps[-1])), min(caps[0], r - 1))
            lst = r - f
            if not (1 <= f <= caps[0] and 1 <= lst <= caps[-1]):
                continue
            t = max(f / v0, lst / vl, t_mid)
            spread = (f / v0) ** 2 + (lst / vl) ** 2 + (pp - 2) * t_mid ** 2   # ties: the most even
            if t < best_t * (1 - 1e-12) or (t <= best_t * (1 + 1e-12) and spread < best_spread):
                best, best_t, best_spread = [f, *[m] * (pp - 2), lst], t, spread
    return best


def _caps(topo: Topology, model: ModelSpec, dc: tuple[tuple[str, ...], ...], tp: int) -> list[int]:
    """The most layers each stage holds on every one of its replicas' GPUs (stock NCCL buffers)."""
    pp, dp = len(dc), len(dc[0])
    M = model.micro_batches(dp)
    caps = []
    for s in range(pp):
        per_layer = model.stage_memory(1, min(pp - s, M), tp)
        caps.append(min(int((topo.dc(dc[s][d]).gpu_memory
                             - nccl_memory(topo, [dc[x][d] for x in range(pp)], s, tp, dp, False))
                            // per_layer) for d in range(dp)))
    return caps


def _hostfile_orders(topo: Topology) -> list[tuple[str, ...]]:
    names = topo.dc_names
    if len(names) > _ORDERED_DCS:
        return [tuple(names)]
    return [order for k in range(1, len(names) + 1) for order in permutations(names, k)]


def _stock(topo: Topology, model: ModelSpec, split, schedule: str) -> Iterator[Layout]:
    """Every hostfile order and (pp, tp, dp): ranks in hostfile order, stage s on ranks [s·tp·dp, ...)."""
    seen = set()
    for order in _hostfile_orders(topo):
        hosts = [h for d in order for h in topo.dc(d).hosts]
        host_gcd = 0
        for h in hosts:
            host_gcd = gcd(host_gcd, h.slots)
        tps = [t for t in range(1, host_gcd + 1) if host_gcd % t == 0 and (not model.tp or t == model.tp)]
        for pp, tp, dp in degrees(topo, model, tps):
            n = pp * tp * dp
            ranks = []
            for h in hosts:
                take = min(n - len(ranks), h.slots)
                ranks += [h.dc] * take
            if len(ranks) < n:
                continue
            dc = tuple(tuple(ranks[(s * dp + d) * tp] for d in range(dp)) for s in range(pp))
            if (dc, tp) in seen:
                continue
            seen.add((dc, tp))
            speeds = [min(topo.dc(d).gpu_flops for d in stage) for stage in dc]
            layers = split(model.layers, speeds, _caps(topo, model, dc, tp))
            if layers is not None:
                yield Layout(tp, dc, tuple(layers), schedule=schedule)


def deepspeed_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    return _stock(topo, model, even_split, SCHEDULES["deepspeed"])


def megatron_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    return _stock(topo, model, megatron_split, SCHEDULES["megatron"])


def varuna_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    if model.tp not in (None, 1):
        return
    for pp, _, dp in degrees(topo, model, [1]):
        for stage_dc in placements(topo, pp, 1, dp):
            dc = tuple((d,) * dp for d in stage_dc)
            layers = even_split(model.layers, [1.0] * pp, _caps(topo, model, dc, 1))
            if layers is not None:
                yield Layout(1, dc, tuple(layers), schedule=SCHEDULES["varuna"])


def dp_wan_layouts(topo: Topology, model: ModelSpec) -> Iterator[Layout]:
    max_slots = max(h.slots for h in topo.hosts)
    tps = [t for t in range(1, max_slots + 1) if max_slots % t == 0 and (not model.tp or t == model.tp)]
    names = topo.dc_names
    subsets = ([names[:k] for k in range(1, len(names) + 1)] if len(names) > _ORDERED_DCS else
               [[d for i, d in enumerate(names) if mask >> i & 1] for mask in range(1, 2 ** len(names))])
    seen = set()
    for pp, tp, dp in degrees(topo, model, tps):
        for dcs in subsets:
            cap = {d: usable_gpus(topo, d, tp) // (pp * tp) for d in dcs}
            holders = [d for d in dcs if cap[d]]
            if len(holders) < len(dcs) or dp > sum(cap.values()) or dp < len(holders):
                continue
            counts = dict.fromkeys(holders, 0)
            left = dp
            while left:                      # one replica per DC in turn, as far as each holds
                for d in holders:
                    if left and counts[d] < cap[d]:
                        counts[d] += 1
                        left -= 1
            replicas = tuple(d for d in holders for _ in range(counts[d]))   # ranks ordered by DC
            lay = Layout(tp, (replicas,) * pp, tuple(stage_layers(model.layers, pp)),
                         schedule=SCHEDULES["dp-wan"])
            if lay not in seen:
                seen.add(lay)
                yield lay


LAYOUTS = {"deepspeed": deepspeed_layouts, "megatron": megatron_layouts, "varuna": varuna_layouts,
           "dp-wan": dp_wan_layouts}
