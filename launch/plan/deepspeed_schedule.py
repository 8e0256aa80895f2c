"""DeepSpeed's pipeline engine as it really runs: its instruction stream and blocking point-to-point calls.

``Job(schedule="deepspeed")`` makes :func:`launch.plan.simulate.simulate` run this executor instead of
the idealised 1F1B (checked against real DeepSpeed runs: benchmarks/atlas_calibration.py). What
DeepSpeed 0.19's ``PipelineEngine.train_batch`` does on every rank:

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
- gloo's rendezvous is receiver-driven (launch.plan.rendezvous): with ``Route.notice`` set, a
  transfer's data leaves at max(send posted, recv posted + notice), and no message lands sooner than
  the path's one-way latency after it left. A stage whose output is a tuple sends its tensors one
  blocking call each (``Job.extra_tensors`` after the activation; DeepSpeed's
  ``_exec_send_activations`` / ``_exec_send_grads``), so each later tensor's receive is posted only
  once the one before it arrived: a round trip per further tensor with the notice modelled. These
  small tensors take no temporal-sharing turn (a few bytes).
- The last step ends with ReduceTiedGrads, ReduceGrads and OptimizerStep: the stage's DP group
  all-reduces its gradients, a collective that starts when every replica of the stage has reached it,
  for ``Collective.seconds`` inside the data centers and, for a group that spans data centers, its WAN
  flows (launch.plan.estimate: ring hops), which share the WAN directions with every transfer still
  in flight; then each replica's ``Job.pipe_syncs`` one-number all-reduces over its stages
  (launch.plan.rendezvous.pipe_all_reduce: ZeRO's overflow flag and gradient norm, or the clipping
  norm); then the last stage broadcasts the loss to the pipeline's other stages over the pipe group
  (a tiny message per stage, one-way latencies summed over the boundaries on the way).

The same executor runs Megatron-LM's order (``Job(schedule="megatron")``,
:mod:`launch.plan.megatron_schedule`): its combined calls post a send and a receive at once and wait
for both (one tensor each: no ``extra_tensors``), and it has no loss broadcast. These are the
schedules the planner ranks layouts by (launch.plan.search): DeepSpeed's for ATLAS and the DeepSpeed
baseline, Megatron's for the others.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from itertools import count

from launch.plan.fluid import Flow, WanDirection, link_for
from launch.plan.rendezvous import pipe_all_reduce, tiny_message
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


def program(schedule: str, stage: int, stages: int, micro_batches: int, tensors: int = 1) -> list[tuple]:
    """A stage's instructions for the executor: ("F" | "B", m), ("step", -1) or ("p2p", channels), a
    blocking call that posts every (channel, m[, tensor]) of ``channels`` at once and returns when all
    are done: DeepSpeed's instructions one call per tensor of the stage's output (``tensors``, in
    order), Megatron's (launch.plan.megatron_schedule) with its combined send+recv calls."""
    if schedule == "megatron":
        from launch.plan import megatron_schedule

        return megatron_schedule.train_schedule(stage, stages, micro_batches)
    out = []
    for k, m in train_schedule(stage, stages, micro_batches):
        out += [(k, m)] if k in ("F", "B", "step") else [("p2p", ((k, m, i),)) for i in range(tensors)]
    return out


def run(job) -> tuple[float, list[tuple], list[Op], float]:
    """One iteration of ``job`` (a :class:`launch.plan.simulate.Job` with schedule "deepspeed" or
    "megatron") on its engine: its length, the transfers (the fields of
    :class:`launch.plan.simulate.Transfer`, in order), the ops, and the bytes over the WAN.
    :func:`launch.plan.simulate.simulate` wraps them in its Result. A job in lockstep
    (:func:`lockstep`) runs one replica and copies it to the others."""
    one = lockstep(job)
    if one is None:
        return _Engine(job).run()
    end, transfers, ops, wan = _Engine(one).run()
    D = job.replicas
    return (end, [(*t[:3], d, *t[4:]) for d in range(D) for t in transfers],
            [Op(o.stage, d, o.kind, o.start, o.end, o.micro_batch) for d in range(D) for o in ops], D * wan)


def lockstep(job):
    """The one-replica job that runs exactly as each of ``job``'s replicas, or None.

    D identical replicas (compute, routes) that share the WAN spatially and whose DP all-reduces stay
    inside the data centers run in lockstep: every WAN direction carries D copies of each transfer at
    once, and fluid.py's per-connection fair share gives each min(window/RTT, bandwidth / (D·w)) per
    connection, what one replica gets on a link of bandwidth/D. So the planner's jobs (every stage in
    one DC) cost one replica's events instead of D's, and their lower bound (launch.plan.bound) is that
    of the one-replica job."""
    D = job.replicas
    if D == 1 or any(len(set(row)) > 1 for row in (*job.t_f, *job.t_b, *job.routes)):
        return None
    if any(c.flows for c in job.collectives):
        return None
    if job.sharing != "spatial" and any(r[0].wan for r in job.routes):
        return None
    routes = tuple((replace(r[0], bandwidth=r[0].bandwidth / D) if r[0].wan else r[0],) for r in job.routes)
    return replace(job, t_f=tuple(t[:1] for t in job.t_f), t_b=tuple(t[:1] for t in job.t_b), routes=routes)


class _Engine:
    def __init__(self, job) -> None:
        self.job = job
        S, D = job.stages, job.replicas
        self.prog = [program(job.schedule, s, S, job.micro_batches, 1 + len(job.extra_tensors))
                     for s in range(S)]
        self.pc = [[0] * D for _ in range(S)]
        self.heap: list[tuple] = []
        self.seq = count()
        self.links: dict[tuple[str, str], WanDirection] = {}
        self.posted: dict[tuple, tuple[str, float]] = {}   # channel -> (side already posted, when)
        self.waiting = [[[0, 0.0] for _ in range(D)] for _ in range(S)]   # [calls left, latest end]
        self.stepping: dict[int, list] = {}   # stage -> [rows in "step", start, end so far, flows left]
        self.syncing: dict[tuple[int, int], list] = {}   # (replica, sync) -> each stage's entry time
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
                _, _, what = heapq.heappop(self.heap)
                if what[0] == "start":        # a transfer whose receiver's notice has reached the sender
                    self._start(what[1], t)
                    continue
                _, s, d = what
                self.pc[s][d] += 1
                self._advance(s, d, t)
        stuck = [(s, d, self.prog[s][self.pc[s][d]]) for s in range(S) for d in range(D)
                 if self.pc[s][d] < len(self.prog[s])]
        if stuck:
            raise RuntimeError(f"simulate: {job.schedule}'s schedule deadlocked at {stuck[:4]}")
        end = max(max(row) for row in self.finished)
        if job.schedule == "deepspeed":
            # DeepSpeed's last stage broadcasts the loss to every other stage of its pipe group
            for d in range(D):
                h = n = 0.0
                for s in range(S - 2, -1, -1):
                    h, n = h + job.routes[s][d].one_way, n + job.routes[s][d].notice
                    end = max(end, tiny_message(self.finished[S - 1][d], self.finished[s][d], h, n)[1])
        return end, self.transfers, self.timeline, sum(link.carried for link in self.links.values())

    def _wake(self, s: int, d: int, t: float) -> None:
        """Row (s, d) completes its current instruction at ``t``."""
        heapq.heappush(self.heap, (t, next(self.seq), ("row", s, d)))

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
            self._step(s, t)
        else:
            self.waiting[s][d] = [len(m), t]
            for name, mb, *tensor in m:
                fwd = name.endswith("act")
                e = (s if name == "send_act" else s - 1) if fwd else (s - 1 if name == "send_grad" else s)
                side = "send" if name.startswith("send") else "recv"
                self._post((e, fwd, mb, d, *(tensor or (0,))), side, t)

    def _step(self, s: int, t: float) -> None:
        """A row of stage s entered the end-of-batch step: the DP group's gradient all-reduce starts
        when all its replicas have (a collective), for ``Collective.seconds`` inside the DCs alongside
        its WAN flows (a group that spans data centers), which share the links with every other
        transfer; then every replica goes on (the optimizer step is part of ``seconds``)."""
        state = self.stepping.setdefault(s, [0, 0.0, 0.0, 0])
        state[0] += 1
        if state[0] < self.job.replicas:
            return
        c = self.job.collectives[s] if self.job.collectives else None
        state[1:] = [t, t + (c.seconds if c else 0.0), len(c.flows) if c else 0]
        for i, w in enumerate(c.flows if c else ()):
            self._link(w.src, w.dst, w.bandwidth, w.stream_cap, t).add(
                Flow(("coll", s, i), t, w.nbytes, w.streams, w.latency), t)
        if state[3] == 0:
            self._step_done(s)

    def _step_done(self, s: int) -> None:
        _, start, end, _ = self.stepping[s]
        for d in range(self.job.replicas):
            if end > start:
                self.timeline.append(Op(s, d, "allreduce", start, end))
            if self.job.pipe_syncs:
                self._sync(s, d, 0, end)
            else:
                self._wake(s, d, end)

    def _sync(self, s: int, d: int, k: int, t: float) -> None:
        """Row (s, d) entered its step's k-th all-reduce over replica d's stages at ``t``; once every
        stage has, each leaves it when launch.plan.rendezvous says, for the next one or the step's end."""
        arrived = self.syncing.setdefault((d, k), [None] * self.job.stages)
        arrived[s] = t
        if any(a is None for a in arrived):
            return
        h, n = [0.0], [0.0]
        for e in range(self.job.stages - 1):      # stage e + 1 to stage 0, boundary by boundary
            r = self.job.routes[e][d]
            h.append(h[-1] + r.one_way)
            n.append(n[-1] + r.notice)
        for stage, done in enumerate(pipe_all_reduce(arrived, h, n)):
            if k + 1 < self.job.pipe_syncs:
                self._sync(stage, d, k + 1, done)
            else:
                self._wake(stage, d, done)

    def _link(self, src: str, dst: str, bandwidth: float, stream_cap: float, t: float) -> WanDirection:
        return link_for(self.links, src, dst, bandwidth, stream_cap, t)

    def _post(self, channel: tuple, side: str, t: float) -> None:
        """One side of a transfer entered its blocking call; the transfer starts when both have."""
        other = self.posted.pop(channel, None)
        if other is None:
            self.posted[channel] = (side, t)
            return
        if other[0] == side:
            raise RuntimeError(f"simulate: two {side}s on one channel {channel}")
        # gloo moves no data before the receiver's notice has reached the sender
        recv_at = other[1] if side == "send" else t
        start = max(t, recv_at + self.job.routes[channel[0]][channel[3]].notice)
        if start > t + _EPS:
            heapq.heappush(self.heap, (start, next(self.seq), ("start", channel)))
        else:
            self._start(channel, t)

    def _start(self, channel: tuple, t: float) -> None:
        e, fwd, m, d, i = channel
        r = self.job.routes[e][d]
        nbytes = self.job.act_bytes if i == 0 else self.job.extra_tensors[i - 1]
        if r.wan is None:
            done = t + nbytes / min(r.bandwidth, r.streams * r.stream_cap)
            if i == 0:
                self.transfers.append((e, fwd, m, d, t, t, done, r.latency, False))
            self._delivered(channel, done, max(done + r.latency, t + r.one_way))
            return
        src, dst = r.wan if fwd else r.wan[::-1]
        link = self._link(src, dst, r.bandwidth, r.stream_cap, t)
        flow = Flow(channel, t, nbytes, r.streams, r.latency)
        if self.job.sharing == "temporal" and i == 0:
            link.add(flow, t, ring=(e, fwd), token=m * len(self.crossing[e]) + self.pos[e][d])
        else:
            link.add(flow, t)

    def _flow_done(self, f: Flow, t: float) -> None:
        if f.key[0] == "coll":
            state = self.stepping[f.key[1]]
            state[2] = max(state[2], f.arrives)
            state[3] -= 1
            if state[3] == 0:
                self._step_done(f.key[1])
            return
        e, fwd, m, d, i = f.key
        arrives = max(f.arrives, f.started + self.job.routes[e][d].one_way)   # no byte lands sooner
        if i == 0:
            self.transfers.append((e, fwd, m, d, f.released, f.started, f.done, f.latency, True))
        src, dst = (e, e + 1) if fwd else (e + 1, e)
        self.timeline.append(Op(src, d, "send", f.started, f.done, m))
        self.timeline.append(Op(dst, d, "recv", f.started + f.latency, arrives, m))
        self._delivered(f.key, f.done, arrives)

    def _delivered(self, channel: tuple, sent: float, arrived: float) -> None:
        """The sender's side of a call is done when its last byte left, the receiver's when it arrived;
        a row's call returns when every transfer it posted is done."""
        e, fwd, _m, d, _i = channel
        src, dst = (e, e + 1) if fwd else (e + 1, e)
        for s, done in ((src, sent), (dst, arrived)):
            w = self.waiting[s][d]
            w[0] -= 1
            w[1] = max(w[1], done)
            if w[0] == 0:
                self._wake(s, d, w[1])
