"""WallFacer's settings: a typed config, its Megatron-LM command-line arguments and their validation.

Megatron-LM takes extra arguments through an ``extra_args_provider(parser) -> parser``. Where that
hook lives changed (wallfacer.md §14):

- tags core_v0.16.x / core_v0.17.x: ``pretrain(..., extra_args_provider=add_wallfacer_args)``;
- main after the config-container rewrite: ``parse_and_validate_args(extra_args_provider=
  add_wallfacer_args, args_defaults=...)`` before ``pretrain(cfg_container, ...)``.

The provider is the same function in both. Validation needs the parsed values of other arguments
(``--context-parallel-size``, ``--seq-length`` ...), so it runs in :meth:`WallFacerConfig.from_args`,
which WallFacerAttention calls when it is built: after parsing, before any communication, on
every rank alike. To chain with another provider: ``lambda p: add_wallfacer_args(mine(p))``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import warnings
from dataclasses import dataclass

from commweave import comm
from megatron_patches.block import KERNELS
from megatron_patches.hybrid import ulysses_error
from megatron_patches.layout import LAYOUTS, team_size_error
from megatron_patches.placement import PLACEMENTS, Topology
from megatron_patches.profile import load, profile_path
from megatron_patches.specs import KERNELS as SPEC_KERNELS
from megatron_patches.specs import PAYLOAD, spec_profile
from megatron_patches.wallfacer import BACKWARDS, TEAM_QKV

CP_COMM_TYPES = (None, "p2p", "wallfacer")


@dataclass(frozen=True, kw_only=True, slots=True)
class WallFacerConfig:
    """How WallFacerAttention runs; one per model, shared by its layers."""

    team_size: int | str = 1
    """C: ranks per team, C² dividing the context-parallel size P; 1 is ring attention; "auto"
    lets the alpha-beta model pick (placement.estimate)."""
    placement: str = "contiguous"
    """contiguous (teams on consecutive CP ranks), node-aware (fewest inter-node bytes) or auto."""
    kernel: str = "auto"
    """Per-block attention kernel: auto, sdpa, flash or reference (block.py)."""
    backward: str = "auto"
    """kv, q or auto (fewer bytes; volume.choose_backward)."""
    team_qkv: str = "auto"
    """keep the team's Q/K/V from the forward, rebuild them in the backward, or auto
    (wallfacer.resolve_team_qkv: rebuild when C > 1 unless the layer is fully recomputed)."""
    ulysses_size: int | str = 1
    """U: Ulysses x WallFacer, a head all-to-all over U consecutive CP ranks, WallFacer over the P/U
    groups (hybrid.py); 1 is WallFacer alone. "auto": the cost model picks U among 1 and the sizes the
    heads allow inside a node (choice.choose_hybrid), with C (when team_size is "auto" too, else the
    given C where C² divides P/U) and the placement order."""
    ranks_per_node: int | None = None
    """Consecutive global ranks per node; None reads LOCAL_WORLD_SIZE (else one node)."""
    bandwidth_gbytes: tuple[float, float, float] = (450.0, 400.0, 50.0)
    """GB/s of one rank's intra-node link, of a node's network (all NICs) and of one rank's NIC,
    for "auto" (default: H100 nodes with NVLink and 8x400 Gb/s InfiniBand)."""
    latency_us: tuple[float, float] = (3.0, 10.0)
    """µs of the intra-node link and of the network."""
    tflops: float = 989.0
    """Dense bf16 TFLOP/s of one rank (for "auto" without a profile; specs.py)."""
    network: str = "ib"
    """ib (RDMA: InfiniBand, RoCE) or ethernet (TCP sockets), for "auto" without a profile (specs.py)."""
    kernel_efficiency: str = "fa2-h100"
    """The attention kernel's published efficiency range (specs.KERNELS), for "auto" without a profile."""
    profile: str | None = None
    """A cost profile (profile.py, from ``python -m megatron_patches.estimate --calibrate``) for "auto";
    None: $COMMWEAVE_WALLFACER_PROFILE, else the spec model of the cluster fields above (auto says so)."""
    layout: str = "zigzag"
    """Which tokens each CP rank holds: zigzag (Megatron's get_batch_on_this_cp_rank, and per document for
    packed batches: get_thd_batch_on_this_cp_rank / packed_batch.get_packed_batch_on_this_cp_rank) or
    contiguous (rank r holds positions [r·s, (r+1)·s): a data path of one's own, DeepSpeed-Ulysses')."""
    context_parallel_size: int | None = None
    """P, when known at parse time: the module checks it against its CP group."""
    timeout_s: float | None = None
    """Bound in seconds on every wait of commweave's communication (``comm.set_timeout``, applied when
    WallFacerAttention is built); None: ``COMMWEAVE_TIMEOUT_S``, else 300."""

    def __post_init__(self) -> None:
        if self.team_size != "auto" and (not isinstance(self.team_size, int) or self.team_size < 1):
            raise ValueError(f"wallfacer team_size={self.team_size!r} must be an int >= 1 or 'auto'")
        for name, allowed in (("placement", PLACEMENTS), ("kernel", KERNELS), ("backward", BACKWARDS),
                              ("team_qkv", TEAM_QKV), ("network", tuple(PAYLOAD)), ("layout", LAYOUTS),
                              ("kernel_efficiency", tuple(SPEC_KERNELS))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"wallfacer {name}={getattr(self, name)!r} is not one of {allowed}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int)
                                                or self.ranks_per_node < 1):
            raise ValueError(f"wallfacer ranks_per_node={self.ranks_per_node!r} must be an integer >= 1")
        bw, lat = self.bandwidth_gbytes, self.latency_us
        finite = all(map(math.isfinite, (*bw, *lat, self.tflops))) and len(bw) == 3 and len(lat) == 2
        if not finite or min(bw) <= 0 or min(lat) < 0 or self.tflops <= 0:
            raise ValueError(f"wallfacer bandwidths {bw} GB/s (3 numbers) and tflops {self.tflops} "
                             f"must be > 0, latencies {lat} us (2 numbers) >= 0, all finite")
        if self.timeout_s is not None:
            comm.check_seconds(self.timeout_s, "--commweave-timeout-s")
        if self.profile is not None:
            _load(self.profile)  # a bad profile is refused here, on every rank, before any communication
        if self.ulysses_size != "auto" and (not isinstance(self.ulysses_size, int)
                                            or isinstance(self.ulysses_size, bool) or self.ulysses_size < 1):
            raise ValueError(f"wallfacer ulysses_size={self.ulysses_size!r} must be an int >= 1 or 'auto'")
        p, u = self.context_parallel_size, 1 if self.ulysses_size == "auto" else self.ulysses_size
        if p is not None and p % u:  # ("auto" can always fall back to U = 1)
            raise ValueError(f"--wallfacer-ulysses-size {u} must divide --context-parallel-size {p}")
        if p is not None and self.team_size != "auto":
            error = team_size_error(p // u, self.team_size)
            if error:
                where = "--context-parallel-size" + ("" if u == 1 else f" / --wallfacer-ulysses-size {u}")
                raise ValueError(f"--wallfacer-team-size: {error} ({where})")

    def node_size(self, world_size: int) -> int:
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    def topology(self, world_size: int) -> Topology:
        """The cost model "auto" plans with: the profile (profile_path) if one is named, else the spec
        profile of the cluster fields (bandwidths, latencies, TFLOP/s, network, kernel efficiency)."""
        path = profile_path(self.profile)
        if path:
            return Topology.from_profile(_load(path), self.node_size(world_size))
        intra, node, rank = self.bandwidth_gbytes
        prof = spec_profile(self.node_size(world_size), intra, node, rank, *self.latency_us,
                            self.tflops, self.network, self.kernel_efficiency)
        return Topology.from_profile(prof)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WallFacerConfig:
        """Validate Megatron-LM's parsed args for WallFacer and return the config (ValueError if bad)."""
        p = getattr(args, "context_parallel_size", 1) or 1
        seq = getattr(args, "seq_length", None)
        if seq is not None and seq % (2 * p):
            raise ValueError(f"--seq-length {seq} must be divisible by 2 x --context-parallel-size = "
                             f"{2 * p}: WallFacer's layouts give each CP rank two of 2P chunks")
        heads, tp = args.num_attention_heads, getattr(args, "tensor_model_parallel_size", 1) or 1
        groups = getattr(args, "num_query_groups", None) or heads
        if heads % groups or heads % tp or (groups % tp and tp % groups):
            raise ValueError(f"--num-attention-heads {heads}, --num-query-groups {groups} and "
                             f"--tensor-model-parallel-size {tp}: heads must be a multiple of query groups "
                             f"and both must split evenly over tensor-parallel ranks")
        u = 1 if args.wallfacer_ulysses_size == "auto" else args.wallfacer_ulysses_size
        if u > 1:
            error = ulysses_error(p, u, heads // tp, max(1, groups // tp))
            if error:
                raise ValueError(f"--wallfacer-ulysses-size: {error} (--num-attention-heads {heads}, "
                                 f"--num-query-groups {groups}, --tensor-model-parallel-size {tp})")
        if getattr(args, "attention_dropout", 0.0):
            raise ValueError(f"--attention-dropout {args.attention_dropout}: WallFacer has no attention "
                             f"dropout; set --attention-dropout 0")
        comm_types = getattr(args, "cp_comm_type", None) or [None]
        for t in comm_types if isinstance(comm_types, list) else [comm_types]:
            if t not in CP_COMM_TYPES:
                raise ValueError(f"--cp-comm-type {t}: WallFacer replaces context parallelism's "
                                 f"communication; use p2p (the default) or wallfacer")
        if (getattr(args, "recompute_granularity", None) == "selective"
                and "core_attn" in (getattr(args, "recompute_modules", None) or [])):
            warnings.warn("--recompute-modules core_attn recomputes WallFacer's whole distributed forward, "
                          "communication included (wallfacer.md §7); prefer full-layer or no recompute",
                          stacklevel=2)
        return cls(team_size=args.wallfacer_team_size, placement=args.wallfacer_placement,
                   kernel=args.wallfacer_kernel, backward=args.wallfacer_backward,
                   team_qkv=args.wallfacer_team_qkv, ulysses_size=args.wallfacer_ulysses_size,
                   ranks_per_node=args.wallfacer_ranks_per_node,
                   bandwidth_gbytes=tuple(args.wallfacer_bandwidth), latency_us=tuple(args.wallfacer_latency),
                   tflops=args.wallfacer_tflops, network=args.wallfacer_network,
                   kernel_efficiency=getattr(args, "wallfacer_kernel_efficiency", "fa2-h100"),
                   profile=getattr(args, "wallfacer_profile", None),
                   layout=getattr(args, "wallfacer_layout", "zigzag"), context_parallel_size=p,
                   timeout_s=getattr(args, "commweave_timeout_s", None))


@functools.lru_cache(maxsize=8)
def _load(path: str):
    return load(path)


def _team_size(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer or 'auto'") from None


def _seconds(value: str) -> float:
    try:
        return comm.check_seconds(value, "--commweave-timeout-s")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_wallfacer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: add the ``--wallfacer-*`` arguments and return the parser."""
    d = WallFacerConfig()
    g = parser.add_argument_group(title="WallFacer attention (commweave)")
    g.add_argument("--wallfacer-team-size", type=_team_size, default=d.team_size,
                   help="Team size C (C² must divide --context-parallel-size; 1 = ring attention) or auto.")
    g.add_argument("--wallfacer-placement", choices=PLACEMENTS, default=d.placement,
                   help="Which CP ranks form teams and sub-rings.")
    g.add_argument("--wallfacer-kernel", choices=KERNELS, default=d.kernel,
                   help="Per-block attention kernel.")
    g.add_argument("--wallfacer-backward", choices=BACKWARDS, default=d.backward,
                   help="Circulate K/V (kv) or queries (q) in the backward; auto picks fewer bytes.")
    g.add_argument("--wallfacer-team-qkv", choices=TEAM_QKV, default=d.team_qkv,
                   help="Keep the team's Q/K/V for the backward or rebuild them there (less memory, "
                        "one more team all-gather); auto rebuilds when C > 1 without full recompute.")
    g.add_argument("--wallfacer-ulysses-size", type=_team_size, default=d.ulysses_size,
                   help="U: head all-to-all over U consecutive CP ranks, WallFacer over the P/U groups "
                        "(1 = WallFacer alone; auto: the cost model picks U, and C with "
                        "--wallfacer-team-size auto, from the cluster arguments below).")
    g.add_argument("--wallfacer-layout", choices=LAYOUTS, default=d.layout,
                   help="Which tokens each CP rank holds: zigzag (Megatron's data path, per document for "
                        "packed batches) or contiguous.")
    g.add_argument("--wallfacer-ranks-per-node", type=int, default=d.ranks_per_node,
                   help="GPUs per node (default: LOCAL_WORLD_SIZE).")
    g.add_argument("--wallfacer-bandwidth", type=float, nargs=3, default=list(d.bandwidth_gbytes),
                   metavar=("INTRA", "NODE", "GPU"),
                   help="GB/s of a GPU's intra-node link, of a node's network and of a GPU's NIC, for auto.")
    g.add_argument("--wallfacer-latency", type=float, nargs=2, default=list(d.latency_us),
                   metavar=("INTRA", "NIC"), help="Latency in µs of the same links, for auto.")
    g.add_argument("--wallfacer-tflops", type=float, default=d.tflops,
                   help="Dense bf16 TFLOP/s per GPU, for auto.")
    g.add_argument("--wallfacer-network", choices=tuple(PAYLOAD), default=d.network,
                   help="ib (RDMA) or ethernet (TCP sockets), for auto.")
    g.add_argument("--wallfacer-kernel-efficiency", choices=tuple(SPEC_KERNELS), default=d.kernel_efficiency,
                   help="The attention kernel's published efficiency range, for auto without a profile.")
    g.add_argument("--wallfacer-profile", default=d.profile,
                   help="Cost profile for auto (python -m megatron_patches.estimate --calibrate writes one; "
                        "default $COMMWEAVE_WALLFACER_PROFILE, else the spec model of the flags above).")
    g.add_argument("--commweave-timeout-s", type=_seconds, default=d.timeout_s,
                   help="Seconds any wait of commweave's communication may take before it raises, naming the "
                        "operation and the peer (default: COMMWEAVE_TIMEOUT_S, else 300).")
    return parser
