"""The simulator's step time for a DeepSpeed pipeline run, from constants measured on the link and the run.

What a prediction takes, and where each figure comes from (nothing here is fitted to step times):

- the WAN: its rate and one TCP connection's window. ``python -m benchmarks.wan`` measures both on the
  user's link (bulk transfers; its JSON's ``link_MBps`` and ``window_fraction``); the window the run
  gets is that fraction of the nodes' effective buffer maximum, min(tcp_rmem, tcp_wmem max), read
  from the nodes (:func:`launch.plan.socket_limits.host_window`), so one connection carries
  window/RTT;
- the compute: each stage's forward (with LoadMicroBatch), backward and end-of-batch step
  (ReduceTiedGrads + ReduceGrads + OptimizerStep), as DeepSpeed's engine timed them
  (:func:`compute_inputs` of the per-instruction medians examples/atlas_pipeline.py records): inputs,
  as a profile is;
- the schedule: DeepSpeed's own instruction order with blocking rendezvous send/recv
  (launch/plan/deepspeed_schedule.py), spatial or temporal sharing, ``connections`` per WAN pair.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launch.plan.simulate import Collective, Job, Route, simulate


@dataclass(frozen=True, slots=True)
class StageCompute:
    forward: float      # seconds per micro-batch (LoadMicroBatch included)
    backward: float
    step: float         # end of the batch: reduce tied grads, DP all-reduce, optimizer step


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

        out.append(StageCompute(med("ForwardPass", "LoadMicroBatch"), med("BackwardPass"),
                                med("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")))
    return out


def step_seconds(compute: Sequence[StageCompute], replicas: int, micro_batches: int, act_bytes: float,
                 rtt: float, bandwidth: float, window: float, wan: WanSetting,
                 wan_boundary: int | None = None) -> float:
    """Seconds per ``train_batch`` of a DeepSpeed pipeline whose boundary ``wan_boundary`` (default: the
    middle one) crosses a WAN of ``rtt`` and ``bandwidth`` bytes/s, one connection reaching
    ``window``/``rtt``; the other boundaries stay inside a data center (taken as free)."""
    S = len(compute)
    if S < 2:
        raise ValueError(f"step_seconds: a pipeline needs >= 2 stages, got {S}")
    cut = (S - 1) // 2 if wan_boundary is None else wan_boundary
    routes = tuple(tuple(Route(rtt / 2, bandwidth, ("a", "b"), wan.connections, window / rtt) if e == cut
                         else Route(0.0, float("inf")) for _ in range(replicas)) for e in range(S - 1))
    job = Job(tuple((c.forward,) * replicas for c in compute),
              tuple((c.backward,) * replicas for c in compute), routes, act_bytes, micro_batches,
              "deepspeed", wan.sharing, tuple(Collective(c.step) for c in compute))
    return simulate(job).iteration
