"""The planner's estimator: what one iteration of a (pp, tp, dp) layout costs on a topology.

The ATLAS paper does not publish its estimator (atlas.md §1.6, [GAP]); this one is ours, built on the
alpha-beta model (:mod:`commweave.cost`) and the discrete-event simulator (:mod:`launch.simulate`).

Per transformer layer (h = hidden, s = sequence, b = micro-batch, n = bytes per element):
    parameters           P = 12·h²                       (QKV + proj 4h², MLP 8h²)
    forward FLOPs        F = 24·b·s·h² + 4·b·s²·h         (2 FLOPs per MAC; attention scores and values)
    backward FLOPs       2·F
    activations kept     34·s·b·h bytes / tp              (Korthikanti et al. 2022, bf16, no recompute)
    TP all-reduces       2 forward + 2 backward of b·s·h·n bytes (Megatron's f/g operators)
    WAN stream caps      one transfer = tp streams x connections x window/RTT (mechanism A)
Per stage: t_f = layers·F/(tp·flops) + TP comm, t_b = 2·layers·F/(tp·flops) + TP comm; every
boundary carries A = b·s·h·n bytes per micro-batch each way; the stage's DP all-reduce moves
layers·P/tp·n bytes over the DC's network. Memory: weights + grads in n bytes and fp32 Adam state
(12 bytes) per parameter, plus 1F1B's in-flight activations (stage s keeps min(pp − s, M) micro-batches),
plus NCCL's staging buffers (launch.sockets.nccl_buffer_memory: NCCL_BUFFSIZE on every communicator).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from commweave import cost
from launch.simulate import Link, Pipeline, simulate
from launch.sockets import nccl_buffer_memory, nccl_buffsize, nccl_communicators
from launch.topology import DataCenter, Topology

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

    def micro_batches(self, dp: int) -> int:
        return self.global_batch // (self.micro_batch * dp)


@dataclass(frozen=True, slots=True)
class Estimate:
    iteration: float       # seconds
    analytic: float        # the closed-form estimate (the simulator's value is `iteration` when run)
    simulated: bool
    utilisation: float     # fraction of GPU time computing
    memory: float          # peak bytes on the most loaded GPU

    @property
    def per_gpu_throughput(self) -> float:
        return self.utilisation / self.iteration


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per stage: as even as possible, the extra layers on the first stages."""
    return [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]


def layout_pipeline(topo: Topology, model: ModelSpec, stage_dc: list[str], tp: int, dp: int,
                    connections: int, sharing: str, window: float) -> tuple[Pipeline, float]:
    """The simulator's view of a layout, and its peak memory per GPU in bytes."""
    pp = len(stage_dc)
    M = model.micro_batches(dp)
    n_act = model.act_bytes
    t_f, t_b, allreduce, memory = [], [], [], 0.0
    for s, (n_layers, dc_name) in enumerate(zip(stage_layers(model.layers, pp), stage_dc, strict=True)):
        dc = topo.dc(dc_name)
        node = cost.AlphaBeta.from_link(dc.intra_latency, dc.node_bandwidth)
        tp_comm = 2 * n_layers * cost.all_reduce(node, n_act, tp)
        compute = n_layers * model.layer_flops / (tp * dc.gpu_flops)
        t_f.append(compute + tp_comm)
        t_b.append(2 * compute + tp_comm)
        grads = n_layers * model.layer_params / tp * model.dtype_bytes
        allreduce.append(cost.all_reduce(_dp_link(dc, tp, dp), grads, dp))
        params = n_layers * model.layer_params / tp
        in_flight = min(pp - s, M)
        acts = in_flight * n_layers * 34 * model.seq * model.micro_batch * model.hidden / tp
        memory = max(memory, params * (2 * model.dtype_bytes + 12) + acts + _nccl(topo, stage_dc, s, tp, dp))
    links = []
    for s in range(pp - 1):
        a, b = stage_dc[s], stage_dc[s + 1]
        if a == b:
            dc = topo.dc(a)
            links.append(Link(dc.intra_latency, dc.intra_bandwidth))
        else:
            w = topo.link(a, b)
            # A replica's boundary transfer is tp parallel streams (each TP rank sends its 1/tp of
            # the activation: sequence parallelism / Megatron's scatter-gather), each over
            # `connections` TCP connections, each capped at window/RTT.
            cap = tp * connections * (w.window or window) / w.rtt
            links.append(Link(w.latency, w.bandwidth, shared=True, per_transfer_cap=cap))
    pipe = Pipeline(t_f, t_b, links, n_act, M, replicas=dp, schedule="1f1b", sharing=sharing,
                    allreduce=allreduce)
    return pipe, memory


def analytic(pipe: Pipeline) -> float:
    """Closed-form iteration time: the slower of the compute-bound and the WAN-bound pipeline.

    compute-bound: (M + S − 1)·max_s(t_f + t_b) + every boundary's latency and one transfer, twice;
    WAN-bound: a direction of a shared link serves M·D transfers back to back, plus the fill and
    drain of the other stages around it. Plus the slowest DP all-reduce.
    """
    S, M, D = len(pipe.t_f), pipe.micro_batches, pipe.replicas
    slowest = max(f + b for f, b in zip(pipe.t_f, pipe.t_b, strict=True))
    hop = [link.latency + pipe.act_bytes / min(link.bandwidth, link.per_transfer_cap)
           for link in pipe.links]
    compute_bound = (M + S - 1) * slowest + 2 * sum(hop)
    wan_bound = 0.0
    for link in pipe.links:
        if link.shared:
            n_flows = 1 if pipe.sharing == "temporal" else D
            rate = min(link.bandwidth, n_flows * link.per_transfer_cap)
            wan_bound = max(wan_bound, M * D * pipe.act_bytes / rate + S * slowest + 2 * link.latency)
    return max(compute_bound, wan_bound) + max(pipe.allreduce or [0.0])


def estimate(topo: Topology, model: ModelSpec, stage_dc: list[str], tp: int, dp: int, connections: int,
             sharing: str, window: float, run_simulation: bool) -> Estimate:
    pipe, memory = layout_pipeline(topo, model, stage_dc, tp, dp, connections, sharing, window)
    closed = analytic(pipe)
    busy = sum(pipe.t_f) + sum(pipe.t_b)
    if not run_simulation:
        return Estimate(closed, closed, False, busy * pipe.micro_batches / (len(stage_dc) * closed), memory)
    res = simulate(pipe)
    return Estimate(res.iteration, closed, True, res.utilisation, memory)


def _nccl(topo: Topology, stage_dc: list[str], s: int, tp: int, dp: int) -> float:
    """NCCL's staging buffers on a GPU of stage s (launch.sockets.nccl_buffer_memory): NCCL_BUFFSIZE is
    raised for the WAN and applies to every communicator the GPU uses."""
    pp = len(stage_dc)
    crossed = [topo.link(a, b) for a, b in itertools.pairwise(stage_dc) if a != b]
    neighbours = sum(0 <= n < pp and stage_dc[n] != stage_dc[s] for n in (s - 1, s + 1))
    return nccl_buffer_memory(nccl_buffsize(crossed), nccl_communicators(pp, tp, dp, s, neighbours))


def _dp_link(dc: DataCenter, tp: int, dp: int) -> cost.AlphaBeta:
    """DP replicas of a stage sit on one host when tp·dp fits in its slots, else across the DC."""
    per_host = min(h.slots for h in dc.hosts)
    if tp * dp <= per_host:
        return cost.AlphaBeta.from_link(dc.intra_latency, dc.node_bandwidth)
    return cost.AlphaBeta.from_link(dc.intra_latency, dc.intra_bandwidth)
