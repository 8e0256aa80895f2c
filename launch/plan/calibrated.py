"""The simulator's step time for a DeepSpeed pipeline run, from constants measured on the link and the run.

What a prediction takes, and where each figure comes from (nothing here is fitted to step times):

- the WAN: the link's rate, and for each way of sending (DeepSpeed's stock send, ATLAS with k
  connections) what one transfer costs after an idle gap, t = alpha + bytes / rate (:class:`LinkMode`),
  from ping-pongs of two sizes on the user's link (``python -m benchmarks.wan --pingpong 64,2048``,
  benchmarks.wan.link_constants): a pipeline's transfers are bursts after idle gaps, where TCP moves
  less than in a bulk transfer, and alpha carries the wake-ups of a busy host. k connections give
  each connection rate/k; several transfers on one link share it per connection (fluid.py);
- the compute: each stage's forward (with LoadMicroBatch), backward and end-of-batch step
  (ReduceTiedGrads + ReduceGrads + OptimizerStep less the time its all-reduces over the pipeline's
  stages took, which is mostly waiting on the other stages), as DeepSpeed's engine timed them
  (:func:`compute_inputs` of the per-instruction medians examples/atlas_pipeline.py records): inputs,
  as a profile is;
- the schedule: DeepSpeed's own instruction order with blocking rendezvous send/recv
  (launch/plan/deepspeed_schedule.py), spatial or temporal sharing, ``connections`` per WAN pair;
  gloo's receiver-driven rendezvous (launch.plan.rendezvous) with the path's one-way latency (half
  the connections' ``minrtt``, measured in the run): each further tensor of a stage's output tuple
  costs a round trip, and the step's all-reduces over the stages (as many as the run's
  OptimizerStep made, ``PipeSync.calls``) are tiny messages to and from stage 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launch.plan.simulate import Collective, Job, Route, simulate
from launch.plan.socket_limits import STRIPE_MIN_BYTES


@dataclass(frozen=True, slots=True)
class StageCompute:
    forward: float      # seconds per micro-batch (LoadMicroBatch included)
    backward: float
    step: float         # end of the batch: reduce tied grads, DP all-reduce, optimizer step


@dataclass(frozen=True, slots=True)
class LinkMode:
    """One transfer alone on the link after an idle gap: ``alpha + bytes / rate`` seconds; and, where
    the ping-pongs timed it, how long the sender's call took to return at each size (``send_return``:
    (bytes, seconds) points): a send returns once its last bytes sit in the kernel's socket buffers."""

    alpha: float
    rate: float
    send_return: tuple[tuple[float, float], ...] = ()

    def returns_before_arrival(self, nbytes: float) -> bool:
        """Whether a send of ``nbytes`` returns before any of its bytes can have arrived (its call
        shorter than alpha, which holds the one-way latency): the whole transfer went into the socket
        buffers at once. Linear between the measured sizes (a send's call grows with the bytes beyond
        the buffers), the nearest size outside them; False where nothing was measured."""
        points = sorted(self.send_return)
        if not points:
            return False
        (b1, t1), (b2, t2) = (points[0], points[-1]) if len(points) > 1 else (points[0], points[0])
        if nbytes <= b1 or b1 == b2:
            t = t1 if nbytes <= b1 else t2
        else:
            t = t1 + (t2 - t1) * (min(nbytes, b2) - b1) / (b2 - b1)
        return t < self.alpha

    @classmethod
    def from_measured(cls, modes: Mapping[str, Mapping[str, float]], setting: str,
                      act_bytes: float = STRIPE_MIN_BYTES) -> LinkMode:
        """From benchmarks.wan.link_constants' ``modes`` (``stock``, ``1``, ``8``, ...). A transfer of
        ``act_bytes`` below STRIPE_MIN_BYTES goes whole over one connection of ATLAS's WAN group: the
        ``1`` mode (the stock one where ``1`` was not measured)."""
        key = "stock" if setting == "stock" else setting.split(":")[0]
        if key not in ("stock", "1") and act_bytes < STRIPE_MIN_BYTES:
            key = "1" if "1" in modes else "stock"
        if key not in modes:
            raise ValueError(f"link constants: no measurement for {key!r} (measured: {sorted(modes)})")
        m = modes[key]
        returns = tuple((float(kib) * 1024, float(t)) for kib, t in m.get("send_return_s", {}).items())
        return cls(float(m["alpha_s"]), float(m["Bps"]), returns)


@dataclass(frozen=True, slots=True)
class WanSetting:
    connections: int = 1
    sharing: str = "spatial"

    @classmethod
    def parse(cls, text: str) -> WanSetting:
        """``stock`` (DeepSpeed's own p2p: one connection, every pipeline at once) or ``K:MODE``."""
        if text == "stock":
            return cls()
        k, _, mode = text.partition(":")
        if not (k.isdigit() and int(k) >= 1 and mode in ("spatial", "temporal")):
            raise ValueError(f"WAN setting {text!r}: use 'stock' or K:spatial | K:temporal with K >= 1")
        return cls(int(k), mode)


def compute_inputs(ops_by_rank: Sequence[tuple[int, Mapping[str, float]]], stages: int) -> list[StageCompute]:
    """Per stage, the median over its ranks of each rank's median instruction seconds;
    ``ops_by_rank``: (stage, {instruction class name: seconds}) of every rank."""
    out = []
    for s in range(stages):
        ops = [o for stage, o in ops_by_rank if stage == s]
        if not ops:
            raise ValueError(f"compute_inputs: no rank reported stage {s}")

        def med(*names, ops=ops):
            return statistics.median(sum(o.get(n, 0.0) for n in names) for o in ops)

        ends = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
        step = statistics.median(sum(o.get(n, 0.0) for n in ends) - o.get("PipeSync", 0.0) for o in ops)
        out.append(StageCompute(med("ForwardPass", "LoadMicroBatch"), med("BackwardPass"), step))
    return out


def pipe_syncs(ops_by_rank: Sequence[Mapping[str, float]]) -> int:
    """How many all-reduces over the pipeline's stages each OptimizerStep ran (``PipeSync.calls`` of
    every rank: a count, the same on every rank since each is a collective over them)."""
    counts = {round(o.get("PipeSync.calls", 0.0)) for o in ops_by_rank}
    if len(counts) != 1:
        raise ValueError(f"pipe_syncs: ranks report different PipeSync.calls {sorted(counts)}: each is a "
                         "collective over the pipeline's stages, every rank runs the same number")
    return counts.pop()


def step_seconds(compute: Sequence[StageCompute], replicas: int, micro_batches: int, act_bytes: float,
                 bandwidth: float, mode: LinkMode, wan: WanSetting, wan_boundary: int | None = None,
                 one_way: float = 0.0, extra_tensors: Sequence[float] = (), syncs: int = 0) -> float:
    """Seconds per ``train_batch`` of a DeepSpeed pipeline whose boundary ``wan_boundary`` (default: the
    middle one) crosses a WAN of ``bandwidth`` bytes/s, where one transfer alone costs ``mode``; the
    other boundaries stay inside a data center (taken as free). ``one_way``: the WAN's one-way latency
    (gloo's recv-ready notice and a tiny message's trip; 0: not modelled); ``extra_tensors``: bytes of
    the further tensors of each stage's output tuple; ``syncs``: the optimizer step's all-reduces over
    the stages (:func:`pipe_syncs`)."""
    S = len(compute)
    if S < 2:
        raise ValueError(f"step_seconds: a pipeline needs >= 2 stages, got {S}")
    cut = (S - 1) // 2 if wan_boundary is None else wan_boundary
    # below STRIPE_MIN_BYTES ATLAS sends a transfer whole, over one connection (mode: that connection's)
    streams = wan.connections if act_bytes >= STRIPE_MIN_BYTES else 1
    # Temporal sharing holds a replica's token while its send call runs (launch/net/wan_p2p.py). Where
    # that call returns before any byte can have arrived (the transfer fits the socket buffers: striped
    # 1 MiB over 8 connections returned in 3 ms against 29 ms one way, calibration 2026-12-02), the
    # token passes at once and the replicas' transfers share the link as with spatial sharing; the
    # token order itself costs nothing in a simulation whose replicas run in lockstep.
    sharing = wan.sharing
    if sharing == "temporal" and mode.returns_before_arrival(act_bytes):
        sharing = "spatial"
    wan_route = Route(mode.alpha, bandwidth, ("a", "b"), streams, mode.rate / streams, one_way)
    routes = tuple((wan_route if e == cut else Route(0.0, float("inf")),) * replicas for e in range(S - 1))
    job = Job(tuple((c.forward,) * replicas for c in compute),
              tuple((c.backward,) * replicas for c in compute), routes, act_bytes, micro_batches,
              "deepspeed", sharing, tuple(Collective(c.step) for c in compute),
              extra_tensors=tuple(extra_tensors), pipe_syncs=syncs)
    return simulate(job).iteration


def choose(compute: Sequence[StageCompute], replicas: int, micro_batches: int, act_bytes: float,
           bandwidth: float, modes: Mapping[str, Mapping[str, float]], settings: Sequence[str],
           margin: float = 0.05, allow_temporal: bool = False, one_way: float = 0.0,
           extra_tensors: Sequence[float] = (), syncs: int = 0) -> tuple[str, dict[str, float]]:
    """The WAN setting (of ``settings``, each measured in ``modes``) the calibrated simulator predicts
    fastest, and every prediction. ``one_way``, ``extra_tensors`` and ``syncs`` are :func:`step_seconds`'
    rendezvous terms (gloo's recv-ready notice, the output tuple's further tensors, the step's
    all-reduces over the stages), the same for every setting: the choice is made on the model the
    predictions are checked with.

    Temporal sharing is not chosen unless ``allow_temporal``: in two runs of the calibration matrix
    (benchmarks/atlas_calibration.py, README) it beat spatial sharing in a DeepSpeed pipeline once in
    16 (RTT, size, connections) groups (1.13x; the same group measured 0.75x in the other run), while
    the simulator, whose replicas run in lockstep, predicted 1.12x and 1.42x there: turns taken in a
    fixed order wait for a replica that jitter made late. With ``allow_temporal`` it is chosen only
    where it beats spatial sharing at the same connection count by more than ``margin``."""
    candidates = [s for s in settings if allow_temporal or not s.endswith(":temporal")]
    predicted = {s: step_seconds(compute, replicas, micro_batches, act_bytes, bandwidth,
                                 LinkMode.from_measured(modes, s, act_bytes), WanSetting.parse(s),
                                 one_way=one_way, extra_tensors=extra_tensors, syncs=syncs)
                 for s in settings}
    best = min(candidates, key=predicted.get)
    if best.endswith(":temporal"):
        spatial = best.replace(":temporal", ":spatial")
        if spatial in predicted and predicted[spatial] <= predicted[best] * (1 + margin):
            best = spatial
    return best, predicted
