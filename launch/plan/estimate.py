"""What one iteration of a layout costs on a topology: the simulator's job for a layout.

The ATLAS paper does not publish its estimator (atlas.md §1.6, [GAP]); this one is ours, built on the
alpha-beta model (:mod:`commweave.cost`) and the discrete-event simulator (:mod:`launch.plan.simulate`).

Per transformer layer (h = hidden, s = sequence, b = micro-batch, n = bytes per element):
    parameters           P = 12·h²                       (QKV + proj 4h², MLP 8h²)
    forward FLOPs        F = 24·b·s·h² + 4·b·s²·h         (2 FLOPs per MAC; attention scores and values)
    backward FLOPs       2·F
    activations kept     34·s·b·h bytes / tp              (Korthikanti et al. 2022, bf16, no recompute)
    TP all-reduces       2 forward + 2 backward of b·s·h·n bytes (Megatron's f/g operators)
Per row (stage s, replica d on a GPU of its DC): t_f = layers·F/(tp·flops) + TP comm, t_b = 2·layers·
F/(tp·flops) + TP comm. Every boundary carries A = b·s·h·n bytes per micro-batch each way, as tp
parallel streams (each TP rank sends its 1/tp: Megatron's scatter-gather / DeepSpeed's partitioned
pipeline activations), each over ``connections`` TCP connections of window/RTT (mechanism A). A
stage's DP all-reduce moves layers·P/tp·n bytes per TP rank: a ring over the DC's network, or, for a
group spanning data centers, a ring whose WAN hops carry 2(D−1)/D of it per direction. Memory per
GPU: weights and grads in n bytes and fp32 Adam state (12 bytes) per parameter, plus 1F1B's
in-flight activations (stage s keeps min(pp − s, M) micro-batches), plus NCCL's staging buffers
(launch.plan.socket_limits.nccl_buffer_memory: NCCL_BUFFSIZE on every communicator; under ATLAS's launcher
BUFFSIZE is raised for the WAN and each WAN neighbour adds a pair group and a token ring).
Under an engine's schedule (DeepSpeed, Megatron) with more than one stage, the optimizer step
all-reduces the gradient norm over each replica's stages once (:data:`PIPE_SYNCS`: both engines clip at
1.0 by default, DeepSpeed's ``gradient_clipping`` and Megatron's ``clip_grad``; a one-number message to
stage 0 and back, launch.plan.rendezvous), the same for every system the planner compares.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, fields
from itertools import pairwise

from commweave import cost
from launch.plan.simulate import ENGINES, Collective, Job, Route, WanFlow
from launch.plan.socket_limits import STRIPE_MIN_BYTES, nccl_buffer_memory, nccl_buffsize, nccl_communicators
from launch.plan.topology import DataCenter, Topology, WanLink

# one-number all-reduces over a replica's stages per optimizer step, at the engines' default clipping
# (DeepSpeed fp32/bf16 without ZeRO: clip_grad_norm_'s; Megatron: get_grad_norm_fp32's): ZeRO-1/2 would
# add one per further parameter group (launch.plan.calibrated counts them in a run)
PIPE_SYNCS = 1
_MODEL_KEYS = {"layers", "hidden", "seq", "micro_batch", "global_batch", "dtype_bytes", "pp", "tp", "dp"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the planner needs to know about the model and the batch (the "model" section)."""

    layers: int
    hidden: int
    seq: int
    global_batch: int          # sequences per iteration (all replicas, all micro-batches)
    micro_batch: int = 1       # sequences per micro-batch
    dtype_bytes: int = 2       # bytes per activation/weight element (bf16)
    pp: int | None = None      # fix a degree of parallelism instead of searching it
    tp: int | None = None
    dp: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in ("pp", "tp", "dp"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f.name} must be a positive integer, got {v!r}")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"model.global_batch ({self.global_batch}) must be a multiple of "
                             f"model.micro_batch ({self.micro_batch})")
        if self.pp is not None and self.pp > self.layers:
            raise ValueError(f"model.pp={self.pp}: more stages than layers ({self.layers})")

    @classmethod
    def from_dict(cls, raw: dict, source: str = "model") -> ModelSpec:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: must be an object with {sorted(_MODEL_KEYS)}, got {raw!r}")
        unknown = sorted(set(raw) - _MODEL_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(_MODEL_KEYS)}")
        missing = sorted({"layers", "hidden", "seq", "global_batch"} - set(raw))
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        return cls(**raw)

    @property
    def layer_params(self) -> int:
        return 12 * self.hidden ** 2

    @property
    def layer_flops(self) -> float:
        b, s, h = self.micro_batch, self.seq, self.hidden
        return 24 * b * s * h * h + 4 * b * s * s * h

    @property
    def act_bytes(self) -> int:
        """Bytes crossing a stage boundary per micro-batch, in each direction."""
        return self.micro_batch * self.seq * self.hidden * self.dtype_bytes

    @property
    def sequences(self) -> int:
        return self.global_batch // self.micro_batch

    def micro_batches(self, dp: int) -> int:
        return self.global_batch // (self.micro_batch * dp)

    def stage_memory(self, layers: int, in_flight: int, tp: int) -> float:
        """Peak bytes per GPU of a stage holding ``layers`` layers and ``in_flight`` micro-batches."""
        params = layers * self.layer_params / tp
        acts = in_flight * layers * 34 * self.seq * self.micro_batch * self.hidden / tp
        return params * (2 * self.dtype_bytes + 12) + acts


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every (stage, replica) runs and how the WAN is used: a candidate of any system."""

    tp: int
    dc: tuple[tuple[str, ...], ...]     # [stage][replica] -> data center
    stage_layers: tuple[int, ...]
    connections: int = 1                # TCP connections per WAN rank pair
    sharing: str = "spatial"            # how replicas share a WAN direction
    atlas_runtime: bool = False         # launched by ATLAS (its NCCL_BUFFSIZE, WAN groups, token rings)
    schedule: str = "1f1b"              # the engine's order it runs (launch.plan.simulate.SCHEDULES)

    @property
    def pp(self) -> int:
        return len(self.dc)

    @property
    def dp(self) -> int:
        return len(self.dc[0])

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def crosses_wan(self) -> bool:
        return len({d for stage in self.dc for d in stage}) > 1


@dataclass(frozen=True, slots=True)
class Estimate:
    iteration: float       # seconds (the simulator's when ``simulated``, else the lower bound)
    lower_bound: float     # launch.plan.bound: no schedule of this layout can be faster
    simulated: bool
    utilisation: float     # fraction of GPU time computing
    memory: float          # peak bytes on the most loaded GPU

    @property
    def per_gpu_throughput(self) -> float:
        return self.utilisation / self.iteration


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per stage: as even as possible, the extra layers on the first stages."""
    return [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]


def split_layers(layers: int, speeds: list[float], caps: list[int]) -> list[int] | None:
    """Layers per stage in proportion to the stages' speeds, at most ``caps[s]`` (memory) each, at
    least one: greedily give the next layer to the stage whose time would grow least, which minimises
    the slowest stage's time (max n_s/v_s). Equal speeds give :func:`stage_layers`. None: no fit."""
    pp = len(speeds)
    if pp > layers or min(caps) < 1 or sum(caps) < layers:
        return None
    n = [1] * pp
    heap = [(2 / v, s) for s, v in enumerate(speeds) if caps[s] > 1]     # (n_s + 1) / v_s
    heapq.heapify(heap)
    for _ in range(layers - pp):
        _, s = heapq.heappop(heap)
        n[s] += 1
        if n[s] < caps[s]:
            heapq.heappush(heap, ((n[s] + 1) / speeds[s], s))
    return n


def layer_caps(topo: Topology, model: ModelSpec, stage_dc: list[str], tp: int, dp: int) -> list[int]:
    """The most layers each stage's GPUs hold under ATLAS (1F1B's in-flight activations and NCCL's
    buffers included)."""
    M = model.micro_batches(dp)
    pp = len(stage_dc)
    return [int((topo.dc(d).gpu_memory - nccl_memory(topo, stage_dc, s, tp, dp, True))
                // model.stage_memory(1, min(pp - s, M), tp)) for s, d in enumerate(stage_dc)]


def nccl_memory(topo: Topology, column: tuple[str, ...] | list[str], s: int, tp: int, dp: int,
                atlas_runtime: bool) -> float:
    """NCCL's staging buffers on a GPU of stage s, whose pipeline replica runs in the DCs ``column``
    (stage -> DC): every communicator it uses holds NCCL_BUFFSIZE per channel, direction and peer.
    ATLAS's launcher raises BUFFSIZE for the WAN links the pipeline crosses and adds, per WAN
    neighbour, its pair group and token ring; a stock launch keeps NCCL's default and its groups."""
    pp = len(column)
    if not atlas_runtime:
        return nccl_buffer_memory(nccl_buffsize([]), nccl_communicators(pp, tp, dp, s, 0))
    crossed = [topo.link(a, b) for a, b in pairwise(column) if a != b]
    neighbours = sum(0 <= n < pp and column[n] != column[s] for n in (s - 1, s + 1))
    return nccl_buffer_memory(nccl_buffsize(crossed), nccl_communicators(pp, tp, dp, s, neighbours))


def _row_memory(topo: Topology, model: ModelSpec, lay: Layout) -> list[tuple[float, str]]:
    """(peak bytes, DC) of every (stage, replica) row."""
    M = model.micro_batches(lay.dp)
    out = []
    for d in range(lay.dp):
        column = [lay.dc[s][d] for s in range(lay.pp)]
        for s, n in enumerate(lay.stage_layers):
            out.append((model.stage_memory(n, min(lay.pp - s, M), lay.tp)
                        + nccl_memory(topo, column, s, lay.tp, lay.dp, lay.atlas_runtime), column[s]))
    return out


def memory(topo: Topology, model: ModelSpec, lay: Layout) -> float:
    """Peak bytes on the most loaded GPU."""
    return max(m for m, _ in _row_memory(topo, model, lay))


def fits(topo: Topology, model: ModelSpec, lay: Layout) -> bool:
    return all(m <= topo.dc(d).gpu_memory for m, d in _row_memory(topo, model, lay))


def link_window(w: WanLink, window: float) -> float:
    """One connection's window on this path: the topology's ``window_mb`` or the planning default."""
    return w.window or window


def build(topo: Topology, model: ModelSpec, lay: Layout, window: float, schedule: str | None = None) -> Job:
    """The simulator's job for a layout (see the module docstring for every cost), run by ``schedule``
    (default: the layout's own, ``lay.schedule``)."""
    tp, dp, A = lay.tp, lay.dp, model.act_bytes
    # ATLAS stripes a transfer over its connections only from STRIPE_MIN_BYTES (launch.net.striping): a
    # smaller one (each TP rank sends A/tp) goes whole over one connection, as the calibration models it
    conns = lay.connections if A / tp >= STRIPE_MIN_BYTES else 1
    t_f, t_b = [], []
    for s, n in enumerate(lay.stage_layers):
        fs, bs = [], []
        for name in lay.dc[s]:
            dc = topo.dc(name)
            tp_comm = 2 * n * cost.all_reduce(cost.AlphaBeta.from_link(dc.intra_latency, dc.node_bandwidth),
                                              A, tp)
            compute = n * model.layer_flops / (tp * dc.gpu_flops)
            fs.append(compute + tp_comm)
            bs.append(2 * compute + tp_comm)
        t_f.append(tuple(fs))
        t_b.append(tuple(bs))
    routes = []
    for e in range(lay.pp - 1):
        row = []
        for a, b in zip(lay.dc[e], lay.dc[e + 1], strict=True):
            if a == b:
                dc = topo.dc(a)
                row.append(Route(dc.intra_latency, tp * dc.intra_bandwidth))
            else:
                w = topo.link(a, b)
                row.append(Route(w.latency, w.bandwidth, (a, b), tp * conns, link_window(w, window) / w.rtt))
        routes.append(tuple(row))
    colls = tuple(_allreduce(topo, model, lay, s, window) for s in range(lay.pp))
    schedule = schedule or lay.schedule
    syncs = PIPE_SYNCS if schedule in ENGINES and lay.pp > 1 else 0
    return Job(tuple(t_f), tuple(t_b), tuple(routes), A, model.micro_batches(dp), schedule, lay.sharing,
               colls, pipe_syncs=syncs)


def _allreduce(topo: Topology, model: ModelSpec, lay: Layout, s: int, window: float) -> Collective:
    """Stage s's DP gradient all-reduce: tp rings (one per TP rank) over the stage's dp replicas, in
    replica (= rank) order, as NCCL and gloo build them. A ring that spans data centers crosses a WAN
    direction wherever consecutive members sit in different DCs: each such hop carries 2(D−1)/D of
    the gradients of every TP rank, over ``connections`` TCP connections per rank pair, while the
    hops inside the DCs run in parallel (``seconds``: the same ring on the slowest DC network). The
    data passes each crossing once in the reduce-scatter lap and once in the all-gather lap: two
    one-way latencies."""
    dcs, D, tp = lay.dc[s], lay.dp, lay.tp
    grads = lay.stage_layers[s] * model.layer_params / tp * model.dtype_bytes
    if len(set(dcs)) == 1:
        return Collective(cost.all_reduce(_dp_link(topo.dc(dcs[0]), tp, D), grads, D))
    slowest = min((topo.dc(d) for d in set(dcs)), key=lambda dc: dc.intra_bandwidth)
    seconds = cost.all_reduce(cost.AlphaBeta.from_link(slowest.intra_latency, slowest.intra_bandwidth),
                              grads, D)
    flows = []
    for i in range(D):
        a, b = dcs[i], dcs[(i + 1) % D]
        if a != b:
            w = topo.link(a, b)
            flows.append(WanFlow(a, b, tp * 2 * (D - 1) / D * grads, w.rtt, w.bandwidth,
                                 tp * lay.connections, link_window(w, window) / w.rtt))
    return Collective(seconds, tuple(flows))


def _dp_link(dc: DataCenter, tp: int, dp: int) -> cost.AlphaBeta:
    """DP replicas of a stage sit on one host when tp·dp fits in its slots, else across the DC."""
    per_host = min(h.slots for h in dc.hosts)
    if tp * dp <= per_host:
        return cost.AlphaBeta.from_link(dc.intra_latency, dc.node_bandwidth)
    return cost.AlphaBeta.from_link(dc.intra_latency, dc.intra_bandwidth)
