"""What-if: one attention layer's forward + backward on a cluster, for every way to shard the sequence.

    python -m megatron_patches.estimate --gpus 16 --gpus-per-node 4 --intra-GBps 150 --inter-Gbps 200 \\
        --latency-us 15 --tflops 300 --hidden 4096 --heads 32 --kv-heads 8 --seq 262144 [--no-causal]

Rows: ring attention (WallFacer with C = 1), DeepSpeed-Ulysses (one all-to-all over all P ranks each
way; only where the heads split over P), WallFacer with every valid team size C, and the hybrid
(U, C): an all-to-all over heads inside groups of U ranks of one node, then WallFacer with team size C
over the P/U groups (each group rank holds U·N/P tokens of h/U heads; K/V heads fewer than U are
replicated to U/g ranks, as hybrid.py sends them). The model is choice.py's plans priced with a cost
profile (profile.py: a measured one, --profile, or the spec profile of the flags, specs.py) — a
projection, not a measurement. ``<- best`` marks the fastest row,
``<- auto`` the plan WallFacerAttention runs with ``--wallfacer-ulysses-size auto --wallfacer-team-size
auto --wallfacer-placement auto`` and the cluster flags printed below the table (DeepSpeed-Ulysses is an
anchor, not a plan auto can run). The last line is JSON: ``{"ring_s", "ulysses_s" (or null),
"wallfacer": {"team_size", "s"} (the best WallFacer alone, U = 1), "best": {"team_size", "ulysses_size",
"s"}, "auto": {"team_size", "ulysses_size", "order", "s"}}``.

``--calibrate`` measures a profile instead (calibrate.py); choice.choose_hybrid is auto's choice.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from megatron_patches.choice import Plan, choose_hybrid, plans, ulysses_s
from megatron_patches.placement import Topology, nodes_of
from megatron_patches.profile import Profile, load
from megatron_patches.specs import KERNELS, PAYLOAD, spec_profile
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
    kernel: str = "fa2-h100"
    profile: Profile | None = None  # a calibrated profile replaces every spec number above but gpus
    profile_path: str | None = None  # where it was read (for the flags auto is told)

    def __post_init__(self) -> None:
        nics = ("nics_per_node",) if self.nics_per_node is not None else ()
        for name in ("gpus", "gpus_per_node", *nics):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be an integer >= 1")
        if self.gpus % min(self.gpus, self.gpus_per_node):
            raise ValueError(f"--gpus {self.gpus} must be a positive multiple of --gpus-per-node "
                             f"{self.gpus_per_node} (or fewer than one node)")
        for flag, value, low in (("--intra-GBps", self.intra_gbytes, 0),
                                 ("--inter-Gbps", self.inter_gbits, 0),
                                 ("--tflops", self.tflops, 0), ("--latency-us", self.latency_us, None),
                                 ("--intra-latency-us", self.intra_latency_us, None)):
            if not math.isfinite(value) or (value <= 0 if low == 0 else value < 0):
                raise ValueError(f"{flag} {value} must be finite and {'> 0' if low == 0 else '>= 0'}")
        if self.network not in PAYLOAD:
            raise ValueError(f"--network {self.network!r} is not one of {sorted(PAYLOAD)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"--kernel {self.kernel!r} is not one of {sorted(KERNELS)}")

    @property
    def nics(self) -> int:
        if self.nics_per_node is not None:
            return self.nics_per_node
        return self.gpus_per_node if self.network == "ib" else 1

    def spec(self) -> Profile:
        node = self.inter_gbits / 8
        return spec_profile(self.gpus_per_node, self.intra_gbytes, node, node / self.nics,
                            self.intra_latency_us, self.latency_us, self.tflops, self.network, self.kernel)

    def topology(self) -> Topology:
        return Topology.from_profile(self.profile or self.spec(), self.gpus_per_node)

    def nodes(self) -> list[int]:
        return nodes_of(range(self.gpus), self.gpus_per_node)

    def wallfacer_flags(self) -> list[str]:
        """The ``--wallfacer-*`` cluster arguments under which WallFacerAttention's "auto" uses this
        topology (args.WallFacerConfig.topology equals :meth:`topology`)."""
        if self.profile_path:
            return ["--wallfacer-ranks-per-node", f"{self.gpus_per_node}",
                    "--wallfacer-profile", self.profile_path]
        node = self.inter_gbits / 8
        return ["--wallfacer-ranks-per-node", f"{self.gpus_per_node}",
                "--wallfacer-bandwidth", *(f"{x:.12g}" for x in (self.intra_gbytes, node, node / self.nics)),
                "--wallfacer-latency", f"{self.intra_latency_us:.12g}", f"{self.latency_us:.12g}",
                "--wallfacer-tflops", f"{self.tflops:.12g}", "--wallfacer-network", self.network,
                "--wallfacer-kernel-efficiency", self.kernel]


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
        kv = ("kv_heads",) if self.kv_heads is not None else ()
        for name in ("hidden", "heads", "seq", "batch", *kv):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be an integer >= 1")
        kv = self.kv_heads or self.heads
        if self.hidden % self.heads or self.heads % kv:
            raise ValueError(f"--hidden {self.hidden} must divide by --heads {self.heads}, and --heads by "
                             f"--kv-heads {kv}")

    def shard(self, world: int) -> Shard:
        if self.seq % (2 * world):
            raise ValueError(f"--seq {self.seq} must be divisible by 2 x --gpus = {2 * world}")
        return Shard(self.seq // world, self.batch, self.heads, self.kv_heads or self.heads,
                     self.hidden // self.heads, self.elt, 4)


def dense_layer_s(cluster: Cluster, model: Model, recompute: bool = True) -> float:
    """One transformer layer's GEMMs per rank, forward + backward (+ a recomputed forward, as the paper's
    checkpointing does): 24·s·b·H² FLOPs a pass (QKV, output, a 4H MLP), at the profile's GEMM throughput."""
    s = model.seq // cluster.gpus
    gemm = cluster.topology().profile.gemm_tflops
    return (4 if recompute else 3) * 24 * s * model.batch * model.hidden ** 2 / (gemm * 1e12)


def report(cluster: Cluster, model: Model) -> dict:
    topo, nodes, world = cluster.topology(), cluster.nodes(), cluster.gpus
    sh = model.shard(world)
    all_plans = plans(world, sh, nodes, topo, model.causal)
    ring = next(p for p in all_plans if p.ulysses_size == 1 and p.team_size == 1)
    alone = min((p for p in all_plans if p.ulysses_size == 1), key=lambda p: p.seconds)
    auto = choose_hybrid(world, sh, nodes, topo, model.causal)
    best = auto
    uly = ulysses_s(world, sh, nodes, topo, model.causal)
    if uly is not None and uly < best.seconds:
        best = Plan(world, 1, "ulysses", uly)
    return {"ring_s": ring.seconds, "ulysses_s": uly,
            "wallfacer": {"team_size": alone.team_size, "order": alone.order, "s": alone.seconds},
            "best": {"team_size": best.team_size, "ulysses_size": best.ulysses_size, "s": best.seconds},
            "auto": {"team_size": auto.team_size, "ulysses_size": auto.ulysses_size, "order": auto.order,
                     "s": auto.seconds},
            "plans": all_plans, "dense_layer_s": dense_layer_s(cluster, model),
            "_best": best, "_auto": auto}


def _print(cluster: Cluster, model: Model, rep: dict) -> None:
    prof = cluster.topology().profile
    print(f"PROJECTION (cost model, not a measurement; profile: {prof.source}, {prof.description}): one "
          f"attention layer forward + backward, {cluster.gpus} GPUs ({cluster.gpus_per_node}/node), "
          f"{model.seq} tokens, {model.heads} heads ({model.kv_heads or model.heads} K/V) x "
          f"{model.hidden // model.heads}, {'causal' if model.causal else 'no mask'}")
    ring = next(p for p in rep["plans"] if (p.ulysses_size, p.team_size) == (1, 1))
    rows = [("ring attention (C=1)", ring)]
    if rep["ulysses_s"] is not None:
        rows.append((f"DeepSpeed-Ulysses (U={cluster.gpus})", rep["_best"] if rep["_best"].order == "ulysses"
                     else Plan(cluster.gpus, 1, "ulysses", rep["ulysses_s"])))
    else:
        print(f"  DeepSpeed-Ulysses: n/a ({model.heads} heads do not split over {cluster.gpus} GPUs)")
    for p in rep["plans"]:
        if p is not ring:
            name = f"WallFacer C={p.team_size}" if p.ulysses_size == 1 else \
                f"hybrid U={p.ulysses_size} x WallFacer C={p.team_size}"
            rows.append((f"{name} ({p.order})" if p.team_size > 1 else name, p))
    print(f"  {'':44s} {'ms':>9s} {'vs ring':>8s}")
    for name, p in rows:
        marks = [m for m, chosen in (("best", rep["_best"]), ("auto", rep["_auto"])) if p == chosen]
        mark = f"  <- {', '.join(marks)}" if marks else ""
        print(f"  {name:44s} {1e3 * p.seconds:9.2f} {rep['ring_s'] / p.seconds:7.2f}x{mark}")
    print(f"  (the layer's GEMMs, for scale: {1e3 * rep['dense_layer_s']:.2f} ms)")
    auto = rep["auto"]
    print(f"  auto: WallFacerAttention with --wallfacer-ulysses-size auto --wallfacer-team-size auto "
          f"--wallfacer-placement auto {' '.join(cluster.wallfacer_flags())} runs U={auto['ulysses_size']}, "
          f"C={auto['team_size']} ({auto['order']})")


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--calibrate" in argv:  # measure a profile (calibrate.py has its own flags)
        from megatron_patches import calibrate

        return calibrate.main([x for x in argv if x != "--calibrate"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's profile instead (python -m megatron_patches.calibrate -h)")
    p.add_argument("--profile", default=None,
                   help="a cost profile (JSON, profile.py) instead of the spec flags below")
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-GBps", type=float, default=450.0, help="one GPU's link in a node, GB/s one way")
    p.add_argument("--inter-Gbps", type=float, default=3200.0, help="a node's network, all NICs, Gb/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="network latency per message")
    p.add_argument("--intra-latency-us", type=float, default=3.0, help="latency per message inside a node")
    p.add_argument("--tflops", type=float, default=989.0, help="one GPU's dense bf16 TFLOP/s")
    p.add_argument("--network", choices=sorted(PAYLOAD), default="ib",
                   help="ib: RDMA (InfiniBand, RoCE); ethernet: TCP sockets (payload share, specs.py)")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="fa2-h100",
                   help="the attention kernel's published efficiency range (specs.py)")
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
        prof = load(a.profile) if a.profile else None
        per_node = prof.ranks_per_node if prof and "--gpus-per-node" not in argv else a.gpus_per_node
        cluster = Cluster(a.gpus, per_node, a.intra_GBps, a.inter_Gbps, a.latency_us, a.tflops,
                          a.network, a.nics_per_node, a.intra_latency_us, a.kernel, prof, a.profile)
        model = Model(a.hidden, a.heads, a.kv_heads, a.seq, a.batch, a.causal)
        rep = report(cluster, model)
    except ValueError as e:
        p.error(str(e))
    _print(cluster, model, rep)
    line = {k: v for k, v in rep.items() if k not in ("plans", "dense_layer_s", "_best", "_auto")}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
