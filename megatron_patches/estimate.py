"""What-if: one attention layer's forward + backward on a cluster, for every way to shard the sequence.

    python -m megatron_patches.estimate --gpus 16 --gpus-per-node 4 --intra-GBps 150 --inter-Gbps 200 \\
        --latency-us 15 --tflops 300 --hidden 4096 --heads 32 --kv-heads 8 --seq 262144 [--no-causal]

Rows: ring attention (WallFacer with C = 1), DeepSpeed-Ulysses (one all-to-all over all P ranks each
way; only where the heads split over P), WallFacer with every valid team size C, and the hybrid
(U, C): an all-to-all over heads inside groups of U ranks of one node, then WallFacer with team size C
over the P/U groups (each group rank holds U·N/P tokens of h/U heads). The model is placement.py's
calibrated alpha-beta model (placement.Calibration) — a projection, not a measurement. The last line
is JSON: ``{"ring_s", "ulysses_s" (or null), "wallfacer": {"team_size", "s"} (the best WallFacer
alone, U = 1), "best": {"team_size", "ulysses_size", "s"}, ...}``.

:func:`choose_hybrid` is the same choice for WallFacerAttention's ``auto`` (one CP group's shards).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from commweave.cost import AlphaBeta
from megatron_patches.layout import Layout, valid_team_sizes
from megatron_patches.placement import BWD_FLOPS, NETWORKS, ORDERS, Topology, estimate, nodes_of
from megatron_patches.volume import Shard


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. ``inter_gbits``: a node's network, all its NICs together (Gb/s);
    ``intra_gbytes``: one GPU's link inside a node, GB/s per direction; ``tflops``: one GPU's dense bf16
    TFLOP/s; ``nics_per_node``: default one per GPU on InfiniBand (rail-optimised), one on Ethernet."""

    gpus: int
    gpus_per_node: int
    intra_gbytes: float = 450.0
    inter_gbits: float = 3200.0
    latency_us: float = 10.0
    tflops: float = 989.0
    network: str = "ib"
    nics_per_node: int | None = None
    intra_latency_us: float = 3.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % min(self.gpus, self.gpus_per_node):
            raise ValueError(f"--gpus {self.gpus} must be a positive multiple of --gpus-per-node "
                             f"{self.gpus_per_node} (or fewer than one node)")
        if min(self.intra_gbytes, self.inter_gbits, self.tflops) <= 0 or self.latency_us < 0:
            raise ValueError("bandwidths and --tflops must be > 0, --latency-us >= 0")
        if self.network not in NETWORKS:
            raise ValueError(f"--network {self.network!r} is not one of {sorted(NETWORKS)}")

    @property
    def nics(self) -> int:
        if self.nics_per_node is not None:
            return self.nics_per_node
        return self.gpus_per_node if self.network == "ib" else 1

    def topology(self) -> Topology:
        node = self.inter_gbits / 8
        return Topology.from_specs(self.gpus_per_node, self.intra_gbytes, node, self.intra_latency_us,
                                   self.latency_us, self.tflops, rank_nic_gbytes=node / self.nics,
                                   calib=NETWORKS[self.network])

    def nodes(self) -> list[int]:
        return nodes_of(range(self.gpus), self.gpus_per_node)


@dataclass(frozen=True)
class Model:
    """One attention layer: hidden size, query and K/V heads, sequence length, batch, mask."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int | None = None
    seq: int = 131072
    batch: int = 1
    causal: bool = True
    elt: int = 2

    def __post_init__(self) -> None:
        kv = self.kv_heads or self.heads
        if self.hidden % self.heads or self.heads % kv:
            raise ValueError(f"--hidden {self.hidden} must divide by --heads {self.heads}, and --heads by "
                             f"--kv-heads {kv}")

    def shard(self, world: int) -> Shard:
        if self.seq % (2 * world):
            raise ValueError(f"--seq {self.seq} must be divisible by 2 x --gpus = {2 * world}")
        return Shard(self.seq // world, self.batch, self.heads, self.kv_heads or self.heads,
                     self.hidden // self.heads, self.elt, 4)


@dataclass(frozen=True)
class Plan:
    ulysses_size: int
    team_size: int
    order: str
    seconds: float


def _all_to_all(sh: Shard, u: int, nodes: list[int], topo: Topology) -> float:
    """The head all-to-alls of one forward + backward over groups of u consecutive ranks: q, k, v in
    and O out; dO in and dq, dk, dv out (each rank keeps (u−1)/u of nothing, sends the rest)."""
    if u == 1:
        return 0.0
    n = 4 * (sh.a_q + sh.a_kv) * sh.elt
    group_nodes = nodes[:u]
    per_node = group_nodes.count(group_nodes[0])
    if per_node == u:
        return 4 * (u - 1) * topo.intra.alpha + topo.intra.beta * n * (u - 1) / u
    # Across nodes: the node's NICs carry every local rank's share that leaves the node.
    inter = n * (u - per_node) / u * per_node * topo.nic.beta
    intra = n * (per_node - 1) / u * topo.intra.beta
    return 4 * (u - 1) * topo.nic.alpha + max(inter, intra)


def _hybrid_parts(sh: Shard, u: int, nodes: list[int], topo: Topology):
    """The WallFacer problem each of the u parallel groups solves, with the network it shares."""
    inner = Shard(sh.s * u, sh.b, sh.hq // u, max(sh.hkv // u, 1), sh.d, sh.elt, sh.acc)
    sub_nodes = nodes[::u]
    shared = replace(topo, nic=AlphaBeta(topo.nic.alpha, topo.nic.beta * u))
    return inner, sub_nodes, shared


def hybrid_s(world: int, sh: Shard, nodes: list[int], topo: Topology, u: int, c: int,
             causal: bool = True) -> tuple[float, str]:
    """Seconds of (U, C) and the better slot order of its WallFacer part."""
    inner, sub_nodes, shared = _hybrid_parts(sh, u, nodes, topo)
    p = world // u
    best = min((estimate(Layout(p, c, order(p, c)), inner, sub_nodes, shared, causal), name)
               for name, order in ORDERS.items())
    return best[0] + _all_to_all(sh, u, nodes, topo), best[1]


def ulysses_s(world: int, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> float | None:
    """DeepSpeed-Ulysses over all P ranks (K/V heads repeated up to P when fewer), or None when the
    query heads do not split over P."""
    if sh.hq % world or (sh.hkv % world and world % sh.hkv):
        return None
    kv = Shard(sh.s, sh.b, sh.hq, max(sh.hkv, world), sh.d, sh.elt, sh.acc)
    n_rows = sh.s * world
    flops = 4 * sh.b * (sh.hq // world) * n_rows ** 2 * sh.d * (0.5 if causal else 1.0)
    attn = (1 + BWD_FLOPS) * topo.calib.kernel_s(flops, n_rows, topo.flops)
    return attn + _all_to_all(kv, world, nodes, topo)


def hybrid_sizes(world: int, sh: Shard, ranks_per_node: int) -> list[int]:
    """U > 1 for the hybrid: U | P, U inside a node, heads and K/V heads split by U (no K/V expansion)."""
    return [u for u in range(2, min(world, ranks_per_node) + 1)
            if world % u == 0 and ranks_per_node % u == 0 and sh.hq % u == 0 and sh.hkv % u == 0]


def plans(world: int, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> list[Plan]:
    """Every (U, C), U = 1 first (WallFacer alone; C = 1 is ring attention)."""
    out = []
    for u in [1, *hybrid_sizes(world, sh, topo.ranks_per_node)]:
        for c in valid_team_sizes(world // u):
            t, order = hybrid_s(world, sh, nodes, topo, u, c, causal)
            out.append(Plan(u, c, order, t))
    return out


def choose_hybrid(world: int, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> Plan:
    """The fastest (U, C) for one CP group's shards (``nodes``: each CP rank's node)."""
    return min(plans(world, sh, nodes, topo, causal), key=lambda p: p.seconds)


def dense_layer_s(cluster: Cluster, model: Model, recompute: bool = True) -> float:
    """One transformer layer's GEMMs per rank, forward + backward (+ a recomputed forward, as the paper's
    checkpointing does): 24·s·b·H² FLOPs a pass (QKV, output, a 4H MLP), at 60% of the dense peak."""
    s = model.seq // cluster.gpus
    return (4 if recompute else 3) * 24 * s * model.batch * model.hidden ** 2 / (0.6 * cluster.tflops * 1e12)


def report(cluster: Cluster, model: Model) -> dict:
    topo, nodes, world = cluster.topology(), cluster.nodes(), cluster.gpus
    sh = model.shard(world)
    all_plans = plans(world, sh, nodes, topo, model.causal)
    ring = next(p for p in all_plans if p.ulysses_size == 1 and p.team_size == 1)
    alone = min((p for p in all_plans if p.ulysses_size == 1), key=lambda p: p.seconds)
    best = min(all_plans, key=lambda p: p.seconds)
    uly = ulysses_s(world, sh, nodes, topo, model.causal)
    if uly is not None and uly < best.seconds:
        best = Plan(world, 1, "ulysses", uly)
    return {"ring_s": ring.seconds, "ulysses_s": uly,
            "wallfacer": {"team_size": alone.team_size, "order": alone.order, "s": alone.seconds},
            "best": {"team_size": best.team_size, "ulysses_size": best.ulysses_size, "s": best.seconds},
            "plans": all_plans, "dense_layer_s": dense_layer_s(cluster, model)}


def _print(cluster: Cluster, model: Model, rep: dict) -> None:
    print(f"PROJECTION (calibrated alpha-beta model, not a measurement): one attention layer forward + "
          f"backward, {cluster.gpus} GPUs ({cluster.gpus_per_node}/node, {cluster.intra_gbytes:g} GB/s "
          f"intra, {cluster.inter_gbits:g} Gb/s {cluster.network} per node), {model.seq} tokens, "
          f"{model.heads} heads ({model.kv_heads or model.heads} K/V) x {model.hidden // model.heads}, "
          f"{'causal' if model.causal else 'no mask'}")
    best = rep["best"]
    rows = [("ring attention (C=1)", rep["ring_s"], 1, 1)]
    if rep["ulysses_s"] is not None:
        rows.append((f"DeepSpeed-Ulysses (U={cluster.gpus})", rep["ulysses_s"], cluster.gpus, 1))
    else:
        print(f"  DeepSpeed-Ulysses: n/a ({model.heads} heads do not split over {cluster.gpus} GPUs)")
    for p in rep["plans"]:
        if (p.ulysses_size, p.team_size) != (1, 1):
            name = f"WallFacer C={p.team_size}" if p.ulysses_size == 1 else \
                f"hybrid U={p.ulysses_size} x WallFacer C={p.team_size}"
            rows.append((f"{name} ({p.order})", p.seconds, p.ulysses_size, p.team_size))
    print(f"  {'':44s} {'ms':>9s} {'vs ring':>8s}")
    for name, t, u, c in rows:
        mark = "  <- best" if (u, c) == (best["ulysses_size"], best["team_size"]) else ""
        print(f"  {name:44s} {1e3 * t:9.2f} {rep['ring_s'] / t:7.2f}x{mark}")
    print(f"  (the layer's GEMMs, for scale: {1e3 * rep['dense_layer_s']:.2f} ms)")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-GBps", type=float, default=450.0, help="one GPU's link in a node, GB/s one way")
    p.add_argument("--inter-Gbps", type=float, default=3200.0, help="a node's network, all NICs, Gb/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="network latency per message")
    p.add_argument("--tflops", type=float, default=989.0, help="one GPU's dense bf16 TFLOP/s")
    p.add_argument("--network", choices=sorted(NETWORKS), default="ib",
                   help="ib: RDMA (InfiniBand, RoCE); ethernet: TCP sockets (see placement.Calibration)")
    p.add_argument("--nics-per-node", type=int, default=None,
                   help="default: one per GPU on ib, 1 on ethernet")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    a = p.parse_args(argv)
    try:
        cluster = Cluster(a.gpus, a.gpus_per_node, a.intra_GBps, a.inter_Gbps, a.latency_us, a.tflops,
                          a.network, a.nics_per_node)
        model = Model(a.hidden, a.heads, a.kv_heads, a.seq, a.batch, a.causal)
        rep = report(cluster, model)
    except ValueError as e:
        p.error(str(e))
    _print(cluster, model, rep)
    line = {k: v for k, v in rep.items() if k not in ("plans", "dense_layer_s")}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
