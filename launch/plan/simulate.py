"""A discrete-event what-if simulator of one pipeline-parallel iteration across data centers.

``schedule="deepspeed"`` / ``"megatron"`` run the engines' own call order instead
(launch.plan.deepspeed_schedule: what the planner ranks layouts by, checked against real runs); the
idealised schedules here keep the design note's worked examples. What they model (atlas.md §1.5–1.6;
the choices are ours where the paper's text was not available):

- D data-parallel replicas of an S-stage pipeline; stage s of replica d (a "row": its tp GPUs run
  in lockstep) runs its schedule (1F1B or GPipe) over M micro-batches: ``F(s, m)`` takes
  ``t_f[s][d]``, ``B(s, m)`` takes ``t_b[s][d]`` (replicas may sit on GPUs of different speeds).
  F(s, m) needs the activation of micro-batch m from stage s−1, B(s, m) the gradient from s+1.
- Sends block: a row that finished an op waits until its send of that op's output has left (the
  last byte), as DeepSpeed's pipeline engine (``p2p.send`` in instruction order), Megatron's
  ``send_forward_recv_backward`` & co. (they wait on their requests unless ``overlap_p2p_comm``) and
  ATLAS's own WAN p2p (launch/net/wan_p2p.py: a temporal send holds the token until its transfer is
  done) all do; with temporal sharing that includes waiting for the token. ``blocking_sends=False``
  posts the send and goes on computing (the idealised pipeline of atlas.md §1.5).
- Every (boundary, replica) has a :class:`Route`. A private route (inside a DC) costs latency +
  bytes/rate. A WAN route puts the transfer on a shared direction of a WAN link
  (:class:`launch.plan.fluid.WanDirection`): striped over ``streams`` TCP connections each capped at
  ``stream_cap`` (window/RTT), shared with every other transfer on that direction, spatially (all at
  once, per-connection fair) or temporally (token rings per boundary and direction).
- After the last backward of all replicas of stage s, the stage's data-parallel gradient all-reduce
  (:class:`Collective`) runs: ``seconds`` inside the data centers and, for a group that spans data
  centers, WAN flows that share the links with everything else. The iteration ends with the last op.

The result keeps every op (:class:`launch.plan.timeline.Op`) of the iteration: what the timeline draws
and what BubbleTea reads its idle windows from. The worked example of atlas.md §1.5 and the design
note's toy table are reproduced exactly by tests/launch/plan/test_simulate.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

from launch.plan.fluid import Flow, WanDirection, link_for
from launch.plan.timeline import Op

INF = float("inf")
_EPS = 1e-12
# "1f1b"/"gpipe": the idealised schedules below; "deepspeed"/"megatron": the engines' own call order with
# blocking rendezvous p2p (launch.plan.deepspeed_schedule, the model checked against real runs)
SCHEDULES = ("1f1b", "gpipe", "deepspeed", "megatron")
ENGINES = ("deepspeed", "megatron")


@dataclass(frozen=True, slots=True)
class Route:
    """How one replica's transfer crosses a boundary; forward goes wan[0] -> wan[1], backward back."""

    latency: float                    # one way, seconds
    bandwidth: float                  # bytes/s of the path (the whole WAN link for a WAN route)
    wan: tuple[str, str] | None = None   # None: a private path inside a data center
    streams: int = 1                  # TCP connections the transfer is striped over
    stream_cap: float = INF           # bytes/s one connection reaches (window/RTT)
    notice: float = 0.0               # gloo's recv-ready notice, one way: a send moves no data before
                                      # the receiver's notice reached it (launch.plan.rendezvous);
                                      # 0: data moves once both sides are in the call

    @property
    def one_way(self) -> float:
        """Seconds a message of a few bytes takes: the path's one-way latency (``latency`` may be a
        fitted transfer intercept below it; the notice travels the path's whole latency)."""
        return max(self.latency, self.notice)

    def alone(self, nbytes: float) -> float:
        """Seconds from the first byte sent to the last byte received with the path to itself."""
        return self.latency + nbytes / min(self.bandwidth, self.streams * self.stream_cap)


@dataclass(frozen=True, slots=True)
class WanFlow:
    """The bytes a collective pushes through one WAN direction."""

    src: str
    dst: str
    nbytes: float
    latency: float
    bandwidth: float
    streams: int = 1
    stream_cap: float = INF


@dataclass(frozen=True, slots=True)
class Collective:
    """A stage's DP all-reduce: ``seconds`` inside DCs, overlapped with its WAN ``flows`` (if any)."""

    seconds: float = 0.0
    flows: tuple[WanFlow, ...] = ()


@dataclass(frozen=True, slots=True)
class Job:
    t_f: tuple[tuple[float, ...], ...]        # [stage][replica] seconds per micro-batch
    t_b: tuple[tuple[float, ...], ...]
    routes: tuple[tuple[Route, ...], ...]     # [boundary s -> s+1][replica]
    act_bytes: float                          # bytes per micro-batch crossing a boundary
    micro_batches: int
    schedule: str = "1f1b"                    # "1f1b" | "gpipe" | "deepspeed" | "megatron" (blocking
                                              # engines: deepspeed_schedule.py, megatron_schedule.py)
    sharing: str = "temporal"                 # "temporal" | "spatial" (WAN p2p transfers)
    collectives: tuple[Collective, ...] = ()  # per stage (empty: none)
    blocking_sends: bool = True               # a row waits for its send to complete (see module doc)
    # the engine executors only (deepspeed_schedule.py): bytes of each further tensor a DeepSpeed p2p
    # instruction sends after the activation, one blocking call each (a stage's output tuple, e.g. the
    # main job's (activation, aux loss)); and how many one-number all-reduces over each replica's
    # stages its optimizer step runs (launch.plan.rendezvous: ZeRO-1/2 2, clipping alone 1)
    extra_tensors: tuple[float, ...] = ()
    pipe_syncs: int = 0

    @property
    def stages(self) -> int:
        return len(self.t_f)

    @property
    def replicas(self) -> int:
        return len(self.t_f[0])

    def __post_init__(self) -> None:
        S = len(self.t_f)
        if S < 1 or len(self.t_b) != S or len(self.routes) != S - 1:
            raise ValueError(f"Job: t_f ({S}), t_b ({len(self.t_b)}) and routes ({len(self.routes)}) "
                             "must describe S stages and S−1 boundaries")
        D = len(self.t_f[0])
        if any(len(x) != D for x in (*self.t_f, *self.t_b, *self.routes)):
            raise ValueError(f"Job: every stage and boundary needs one entry per replica ({D})")
        if self.micro_batches < 1 or D < 1:
            raise ValueError(f"Job: micro_batches={self.micro_batches} and replicas={D} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Job.schedule={self.schedule!r}: use one of {SCHEDULES}")
        if self.sharing not in ("temporal", "spatial"):
            raise ValueError(f"Job.sharing={self.sharing!r}: use 'temporal' or 'spatial'")
        if self.pipe_syncs < 0 or any(b < 0 for b in self.extra_tensors):
            raise ValueError(f"Job: pipe_syncs={self.pipe_syncs} and extra_tensors={self.extra_tensors} "
                             "must be >= 0")
        if self.pipe_syncs and self.schedule not in ENGINES:
            raise ValueError(f"Job: pipe_syncs={self.pipe_syncs} needs an engine schedule {ENGINES}, got "
                             f"schedule={self.schedule!r}")
        if self.extra_tensors and self.schedule != "deepspeed":
            raise ValueError(f"Job: extra_tensors={self.extra_tensors} needs schedule='deepspeed' "
                             f"(Megatron's p2p sends one tensor), got schedule={self.schedule!r}")
        if self.collectives and len(self.collectives) != S:
            raise ValueError(f"Job.collectives has {len(self.collectives)} entries for {S} stages")


@dataclass(frozen=True, slots=True)
class Link:
    """A boundary every replica crosses the same way (the :class:`Pipeline` shorthand)."""

    latency: float
    bandwidth: float                  # bytes/s of the whole link
    shared: bool = False              # a WAN link shared by the D replicas
    per_transfer_cap: float = INF     # bytes/s one transfer can reach (multi-TCP limit)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Shorthand for a :class:`Job` whose replicas are identical (each shared link its own WAN), with
    asynchronous sends: the idealised pipeline of atlas.md §1.5's worked example and toy table."""

    t_f: Sequence[float]
    t_b: Sequence[float]
    links: Sequence[Link]             # boundary s -> s+1, len S−1
    act_bytes: float
    micro_batches: int
    replicas: int = 1
    schedule: str = "1f1b"
    sharing: str = "temporal"
    allreduce: Sequence[float] = ()   # DP all-reduce seconds per stage

    def __post_init__(self) -> None:
        self.job()   # validates

    def job(self) -> Job:
        D = self.replicas
        if len(self.t_b) != len(self.t_f) or len(self.links) != len(self.t_f) - 1:
            raise ValueError(f"Pipeline: t_f ({len(self.t_f)}), t_b ({len(self.t_b)}) and links "
                             f"({len(self.links)}) must describe S stages and S−1 boundaries")
        routes = tuple(tuple(Route(link.latency, link.bandwidth, (f"s{e}", f"s{e + 1}") if link.shared
                                   else None, 1, link.per_transfer_cap) for _ in range(D))
                       for e, link in enumerate(self.links))
        return Job(tuple((t,) * D for t in self.t_f), tuple((t,) * D for t in self.t_b), routes,
                   self.act_bytes, self.micro_batches, self.schedule, self.sharing,
                   tuple(Collective(a) for a in self.allreduce), blocking_sends=False)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One micro-batch's activation (``fwd``) or gradient crossing boundary ``edge`` for replica d."""

    edge: int
    fwd: bool
    m: int
    d: int
    released: float
    started: float
    done: float
    latency: float
    wan: bool

    @property
    def arrives(self) -> float:
        return self.done + self.latency


@dataclass
class Result:
    iteration: float
    busy: list[float]                    # compute seconds per row (stage-major, then replica)
    transfers: list[Transfer] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    wan_bytes: float = 0.0               # bytes over all WAN directions (p2p and collectives)

    @property
    def utilisation(self) -> float:
        """Mean fraction of the iteration the GPUs compute (forward and backward)."""
        return sum(self.busy) / (len(self.busy) * self.iteration)


def schedule_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order of ("F"|"B", micro-batch) on one stage: GPipe, or non-interleaved 1F1B."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", i) for i in range(m - warm, m)]
    return ops


def simulate(p: Job | Pipeline) -> Result:
    """Run one iteration: its length, every op and transfer, per-row busy time, WAN bytes.
    ``schedule="deepspeed"`` / ``"megatron"``: that engine's call order with its blocking p2p
    (launch.plan.deepspeed_schedule)."""
    job = p.job() if isinstance(p, Pipeline) else p
    if job.schedule in ENGINES:
        from launch.plan import deepspeed_schedule

        end, transfers, ops, wan = deepspeed_schedule.run(job)
        M = job.micro_batches
        busy = [M * (job.t_f[s][d] + job.t_b[s][d]) for s in range(job.stages) for d in range(job.replicas)]
        return Result(end, busy, [Transfer(*t) for t in transfers], ops, wan)
    return _Run(job).run()


class _Run:
    def __init__(self, job: Job) -> None:
        self.job = job
        S, D = job.stages, job.replicas
        self.ops = [schedule_ops(job.schedule, s, S, job.micro_batches) for s in range(S)]
        self.nxt = [[0] * D for _ in range(S)]
        self.running = [[False] * D for _ in range(S)]
        self.arrived: set[tuple] = set()          # (fwd, stage, m, d) inputs that are there
        self.heap: list[tuple] = []
        self.seq = count()
        self.links: dict[tuple[str, str], WanDirection] = {}
        # token ring position of each replica that crosses boundary e on the WAN (temporal sharing)
        self.crossing = [[d for d in range(D) if job.routes[e][d].wan] for e in range(S - 1)]
        self.pos = [{d: i for i, d in enumerate(c)} for c in self.crossing]
        self.left = [D] * S                       # replicas of a stage with ops still to run
        self.coll: dict[int, list] = {}           # stage -> [start, end so far, flows outstanding]
        self.timeline: list[Op] = []
        self.transfers: list[Transfer] = []
        self.end = 0.0

    def run(self) -> Result:
        job, S, D = self.job, self.job.stages, self.job.replicas
        for s in range(S):
            for d in range(D):
                self._try_start(s, d, 0.0)
        t = 0.0
        while True:
            t_next = self.heap[0][0] if self.heap else INF
            for link in self.links.values():
                e = link.next_event()
                if e is not None and e < t_next:
                    t_next = e
            if t_next == INF:
                break
            for link in list(self.links.values()):
                for f in link.advance(t_next):
                    self._flow_done(f)
            t = t_next
            touched = set()
            while self.heap and self.heap[0][0] <= t + _EPS:
                _, _, kind, pay = heapq.heappop(self.heap)
                if kind == "end":
                    touched.add(self._op_end(*pay, t))
                elif kind == "arrive":
                    self.arrived.add(pay)
                    touched.add((pay[1], pay[3]))
                elif kind == "sent":
                    self._row_free(*pay, t)
                    touched.add(pay)
                else:
                    self._collective_end(pay, t)
            for s, d in sorted(touched):
                self._try_start(s, d, t)
        if any(self.nxt[s][d] < len(self.ops[s]) for s in range(S) for d in range(D)):
            raise RuntimeError("simulate: the schedule deadlocked (an input never arrived)")
        M = job.micro_batches
        busy = [M * (job.t_f[s][d] + job.t_b[s][d]) for s in range(S) for d in range(D)]
        wan = sum(link.carried for link in self.links.values())
        return Result(self.end, busy, self.transfers, self.timeline, wan)

    def _push(self, time: float, kind: str, pay) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), kind, pay))

    def _try_start(self, s: int, d: int, t: float) -> None:
        i = self.nxt[s][d]
        if self.running[s][d] or i >= len(self.ops[s]):
            return
        kind, m = self.ops[s][i]
        fwd = kind == "F"
        if ((fwd and s > 0) or (not fwd and s < self.job.stages - 1)) and (fwd, s, m, d) not in self.arrived:
            return
        self.running[s][d] = True
        self.nxt[s][d] = i + 1
        dur = (self.job.t_f if fwd else self.job.t_b)[s][d]
        self._push(t + dur, "end", (s, d, fwd, m, t))

    def _op_end(self, s: int, d: int, fwd: bool, m: int, start: float, t: float) -> tuple[int, int]:
        """Compute of F/B(s, m) on replica d ended at t: post its send; the row is free now, or when
        the send completes (blocking sends)."""
        self.timeline.append(Op(s, d, "forward" if fwd else "backward", start, t, m))
        sends = (fwd and s < self.job.stages - 1) or (not fwd and s > 0)
        if sends:
            self._release(s if fwd else s - 1, fwd, m, d, t)
        if not (sends and self.job.blocking_sends):
            self._row_free(s, d, t)
        return s, d

    def _row_free(self, s: int, d: int, t: float) -> None:
        self.running[s][d] = False
        self.end = max(self.end, t)
        if self.nxt[s][d] == len(self.ops[s]):
            self.left[s] -= 1
            if self.left[s] == 0:
                self._collective_start(s, t)

    def _link(self, src: str, dst: str, bandwidth: float, stream_cap: float, t: float) -> WanDirection:
        return link_for(self.links, src, dst, bandwidth, stream_cap, t)

    def _release(self, e: int, fwd: bool, m: int, d: int, t: float) -> None:
        r, nbytes = self.job.routes[e][d], self.job.act_bytes
        if r.wan is None:
            done = t + nbytes / min(r.bandwidth, r.streams * r.stream_cap)
            self.transfers.append(Transfer(e, fwd, m, d, t, t, done, r.latency, False))
            self._push(done + r.latency, "arrive", (fwd, e + 1 if fwd else e, m, d))
            if self.job.blocking_sends:
                self._push(done, "sent", (e if fwd else e + 1, d))
            return
        src, dst = r.wan if fwd else r.wan[::-1]
        flow = Flow(("p2p", e, fwd, m, d), t, nbytes, r.streams, r.latency)
        link = self._link(src, dst, r.bandwidth, r.stream_cap, t)
        if self.job.sharing == "temporal":
            link.add(flow, t, ring=(e, fwd), token=m * len(self.crossing[e]) + self.pos[e][d])
        else:
            link.add(flow, t)

    def _flow_done(self, f: Flow) -> None:
        if f.key[0] == "coll":
            state = self.coll[f.key[1]]
            state[1] = max(state[1], f.arrives)
            state[2] -= 1
            if state[2] == 0:
                self._push(state[1], "coll", f.key[1])
            return
        _, e, fwd, m, d = f.key
        self.transfers.append(Transfer(e, fwd, m, d, f.released, f.started, f.done, f.latency, True))
        src, dst = (e, e + 1) if fwd else (e + 1, e)
        self.timeline.append(Op(src, d, "send", f.started, f.done, m))
        self.timeline.append(Op(dst, d, "recv", f.started + f.latency, f.arrives, m))
        self._push(f.arrives, "arrive", (fwd, dst, m, d))
        if self.job.blocking_sends:
            self._push(f.done, "sent", (src, d))

    def _collective_start(self, s: int, t: float) -> None:
        c = self.job.collectives[s] if self.job.collectives else Collective()
        if c.seconds <= 0 and not c.flows:
            return
        self.coll[s] = [t, t + c.seconds, len(c.flows)]
        if not c.flows:
            self._push(t + c.seconds, "coll", s)
        for i, w in enumerate(c.flows):
            self._link(w.src, w.dst, w.bandwidth, w.stream_cap, t).add(
                Flow(("coll", s, i), t, w.nbytes, w.streams, w.latency), t)

    def _collective_end(self, s: int, t: float) -> None:
        start = self.coll[s][0]
        for d in range(self.job.replicas):
            self.timeline.append(Op(s, d, "allreduce", start, t))
        self.end = max(self.end, t)
