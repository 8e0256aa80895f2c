"""DeepSpeed's pipeline engine as it really runs: its instruction stream and blocking point-to-point calls.

``Job(schedule="deepspeed")`` makes :func:`launch.plan.simulate.simulate` run this executor instead of
the idealised 1F1B. What DeepSpeed 0.19's ``PipelineEngine.train_batch`` does on every rank:

- It walks ``deepspeed.runtime.pipe.schedule.TrainSchedule`` (reproduced by :func:`train_schedule` and
  compared with DeepSpeed's own in the tests): 2(M + S − 1) steps, a stage's forward steps on one
  parity and backward steps on the other; a forward step sends the *previous* step's gradient and then
  receives this step's activation, a backward step receives this step's gradient and then sends the
  *previous* forward's activation. So the activation of micro-batch m leaves stage s only after s has
  received the gradient of micro-batch m − 1: with 2 stages nothing is in flight while the last stage
  computes, and each micro-batch costs a transfer, the last stage's forward and backward, and a
  transfer back.
- Every instruction runs to completion before the next: ``p2p.send``/``p2p.recv`` are blocking
  ``dist.send``/``dist.recv`` on gloo (ATLAS's striped WAN send waits on its stripes too), so a rank
  never sends and receives at once.
- gloo's TCP pair stops reading a socket until the receiver posts the matching buffer, so a transfer
  moves (beyond a socket buffer's worth) only once both sides are in the call: a transfer starts when
  the later of send and recv is posted (a rendezvous). The sender returns when its last byte has left,
  the receiver one latency later. With temporal sharing the sender first waits for its token
  (launch/net/wan_p2p.py holds it for the whole transfer), modelled by the token rings of
  :class:`launch.plan.fluid.WanDirection`.
- The last step ends with ReduceTiedGrads, ReduceGrads and OptimizerStep (``Collective.seconds`` of the
  stage, inside its data center), then the last stage broadcasts the loss to the pipeline's other
  stages over the pipe group (one one-way latency per boundary on the way back to stage 0).
"""

from __future__ import annotations

import heapq
from itertools import count

from launch.plan.fluid import Flow, WanDirection
from launch.plan.timeline import Op

INF = float("inf")
_EPS = 1e-12


def train_schedule(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """DeepSpeed's ``TrainSchedule(micro_batches, stages, stage).steps()`` flattened to (instruction,
    micro-batch): "F"/"B" compute, "send_act"/"recv_act"/"send_grad"/"recv_grad", and "step" (the
    reduce and optimizer step at the end; micro-batch -1). LoadMicroBatch is part of "F"."""
    M, S, s = micro_batches, stages, stage
    valid = range(M).__contains__
    out, prev = [], -1
    total = 2 * (M + S - 1)
    for step in range(total):
        if step % 2 == s % 2:           # a forward step
            mb, fwd = (step - (step % 2)) // 2 - s // 2, True
        elif step % 2 == 0:             # even step on an odd stage: backward
            mb, fwd = step // 2 - S + (s + 1) // 2, False
        else:                           # odd step on an even stage: backward
            mb, fwd = (step - 1) // 2 - S + 1 + s // 2, False
        if fwd:
            if valid(prev) and s > 0:
                out.append(("send_grad", prev))
            if valid(mb) and s > 0:
                out.append(("recv_act", mb))
        else:
            if valid(mb) and s < S - 1:
                out.append(("recv_grad", mb))
            if valid(prev) and s < S - 1:
                out.append(("send_act", prev))
        if valid(mb):
            out.append(("F" if fwd else "B", mb))
        prev = mb
    out.append(("step", -1))
    return out


def run(job) -> tuple[float, list[tuple], list[Op], float]:
    """One iteration of ``job`` (a :class:`launch.plan.simulate.Job`) under DeepSpeed's engine: its
    length, the transfers (the fields of :class:`launch.plan.simulate.Transfer`, in order), the ops,
    and the bytes over the WAN. :func:`launch.plan.simulate.simulate` wraps them in its Result."""
    return _Engine(job).run()


class _Engine:
    def __init__(self, job) -> None:
        self.job = job
        S, D = job.stages, job.replicas
        for s, c in enumerate(job.collectives):
            if c.flows:
                raise ValueError(f"simulate: schedule 'deepspeed' keeps each stage's DP group in one data "
                                 f"center; stage {s}'s all-reduce crosses the WAN")
        self.prog = [train_schedule(s, S, job.micro_batches) for s in range(S)]
        self.pc = [[0] * D for _ in range(S)]
        self.heap: list[tuple] = []
        self.seq = count()
        self.links: dict[tuple[str, str], WanDirection] = {}
        self.posted: dict[tuple, tuple[str, float]] = {}   # channel -> (side already posted, when)
        self.crossing = [[d for d in range(D) if job.routes[e][d].wan] for e in range(S - 1)]
        self.pos = [{d: i for i, d in enumerate(c)} for c in self.crossing]
        self.finished = [[INF] * D for _ in range(S)]
        self.timeline: list[Op] = []
        self.transfers: list = []

    # -- the event loop --------------------------------------------------------------------------
    def run(self) -> tuple[float, list[tuple], list[Op], float]:
        job, S, D = self.job, self.job.stages, self.job.replicas
        for s in range(S):
            for d in range(D):
                self._advance(s, d, 0.0)
        while True:
            t = self.heap[0][0] if self.heap else INF
            for link in self.links.values():
                e = link.next_event()
                if e is not None and e < t:
                    t = e
            if t == INF:
                break
            for link in list(self.links.values()):
                for f in link.advance(t):
                    self._flow_done(f, t)
            while self.heap and self.heap[0][0] <= t + _EPS:
                _, _, (s, d) = heapq.heappop(self.heap)
                self.pc[s][d] += 1
                self._advance(s, d, t)
        stuck = [(s, d, self.prog[s][self.pc[s][d]]) for s in range(S) for d in range(D)
                 if self.pc[s][d] < len(self.prog[s])]
        if stuck:
            raise RuntimeError(f"simulate: DeepSpeed's schedule deadlocked at {stuck[:4]}")
        # the last stage broadcasts the loss back along the pipeline (pipe group: one hop per boundary)
        end = 0.0
        for d in range(D):
            back = self.finished[S - 1][d]
            end = max(end, back)
            for s in range(S - 2, -1, -1):
                back += job.routes[s][d].latency
                end = max(end, self.finished[s][d], back)
        return end, self.transfers, self.timeline, sum(link.carried for link in self.links.values())

    def _wake(self, s: int, d: int, t: float) -> None:
        """Row (s, d) completes its current instruction at ``t``."""
        heapq.heappush(self.heap, (t, next(self.seq), (s, d)))

    def _advance(self, s: int, d: int, t: float) -> None:
        """Start row (s, d)'s current instruction at ``t``."""
        if self.pc[s][d] >= len(self.prog[s]):
            self.finished[s][d] = min(self.finished[s][d], t)
            return
        kind, m = self.prog[s][self.pc[s][d]]
        job = self.job
        if kind in ("F", "B"):
            dur = (job.t_f if kind == "F" else job.t_b)[s][d]
            self.timeline.append(Op(s, d, "forward" if kind == "F" else "backward", t, t + dur, m))
            self._wake(s, d, t + dur)
        elif kind == "step":
            dur = job.collectives[s].seconds if job.collectives else 0.0
            if dur > 0:
                self.timeline.append(Op(s, d, "allreduce", t, t + dur))
            self._wake(s, d, t + dur)
        else:
            fwd = kind.endswith("act")
            e = (s if kind == "send_act" else s - 1) if fwd else (s - 1 if kind == "send_grad" else s)
            self._post((e, fwd, m, d), "send" if kind.startswith("send") else "recv", t)

    def _post(self, channel: tuple, side: str, t: float) -> None:
        """One side of a transfer entered its blocking call; the transfer starts when both have."""
        other = self.posted.pop(channel, None)
        if other is None:
            self.posted[channel] = (side, t)
            return
        if other[0] == side:
            raise RuntimeError(f"simulate: two {side}s on one channel {channel}")
        self._start(channel, t)

    def _start(self, channel: tuple, t: float) -> None:
        e, fwd, m, d = channel
        r, nbytes = self.job.routes[e][d], self.job.act_bytes
        if r.wan is None:
            done = t + nbytes / min(r.bandwidth, r.streams * r.stream_cap)
            self.transfers.append((e, fwd, m, d, t, t, done, r.latency, False))
            self._delivered(channel, done, done + r.latency)
            return
        src, dst = r.wan if fwd else r.wan[::-1]
        link = self.links.get((src, dst))
        if link is None:
            link = self.links[(src, dst)] = WanDirection(r.bandwidth, r.stream_cap)
            link.t = t
        flow = Flow(channel, t, nbytes, r.streams, r.latency)
        if self.job.sharing == "temporal":
            link.add(flow, t, ring=(e, fwd), token=m * len(self.crossing[e]) + self.pos[e][d])
        else:
            link.add(flow, t)

    def _flow_done(self, f: Flow, t: float) -> None:
        e, fwd, m, d = f.key
        self.transfers.append((e, fwd, m, d, f.released, f.started, f.done, f.latency, True))
        src, dst = (e, e + 1) if fwd else (e + 1, e)
        self.timeline.append(Op(src, d, "send", f.started, f.done, m))
        self.timeline.append(Op(dst, d, "recv", f.started + f.latency, f.arrives, m))
        self._delivered(f.key, f.done, f.arrives)

    def _delivered(self, channel: tuple, sent: float, arrived: float) -> None:
        """The sender's call returns when its last byte left, the receiver's when it arrived."""
        e, fwd, _m, d = channel
        src, dst = (e, e + 1) if fwd else (e + 1, e)
        self._wake(src, d, sent)
        self._wake(dst, d, arrived)
