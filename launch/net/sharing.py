"""Temporal WAN sharing (mechanism C, atlas.md §1.5): the D data-parallel senders of a WAN boundary
take turns, so each transfer has the whole link instead of 1/D of it.

Spatial sharing (stock TCP): D pipelines push their micro-batch at once, each at about B/D; the last
byte lands when it would have anyway, but every pipeline's next stage waits for the slowest.
Temporal sharing: a token goes round the D senders of one boundary and direction in the order
(micro-batch, then replica): (0,0), (0,1), ..., (0,D−1), (1,0), ...; a sender sends only while it
holds the token and passes it on when its transfer has completed. The first replicas' far stages
start a transfer-time earlier and overlap the later transfers with compute.

Realisation: one ring per (stage, direction, tensor-parallel index) over the D replicas of that
stage (they sit in one DC, so the tiny token messages stay off the WAN), each ring on a process group
of its own. NCCL matches point-to-point messages by communicator and peer only (it ignores tags), and
a stage with WAN links on both sides passes the forward and the backward token between the same
replicas in different orders (replica 0 collects the last forward token of an iteration after the
first backward ones): on one shared group it would take the other ring's token. Every replica issues
the same sequence of WAN sends (same schedule, same shapes), so the token order is (send call,
replica); the token carries its sequence number and a replica that receives the wrong one raises
instead of silently reordering. The ring never stops between iterations; :meth:`TemporalSharing.close`
collects the one token still travelling to replica 0 (once: a second close does nothing).

Every token wait is bounded by ``COMMWEAVE_TIMEOUT_S`` (:mod:`commweave.comm`); the error names the
stage, the direction, this replica and the replica (and rank) it waited for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commweave import comm
from launch.plan.plan import Plan


@dataclass
class _Ring:
    group: object
    d: int                     # this replica's index = its rank in the ring group
    replicas: int
    stage: int
    forward: bool              # the ring of the stage's forward (activation) or backward sends
    device: torch.device       # where the token lives: NCCL sends only device tensors
    calls: int = 0             # WAN sends this replica has made on this ring
    pending: list = field(default_factory=list)
    closed: bool = False

    def acquire(self) -> None:
        if self.calls == 0 and self.d == 0:
            return                                   # replica 0 holds the first token
        token = torch.zeros(1, dtype=torch.int64, device=self.device)
        prev = (self.d - 1) % self.replicas
        try:
            comm.recv(token, prev, self.group)
        except comm.CommError as e:
            raise type(e)(f"ATLAS temporal sharing: stage {self.stage} replica {self.d} (rank "
                          f"{dist.get_rank()}) waited for the {self.direction} WAN token of its send "
                          f"{self.calls} from replica {prev} (rank {comm.global_rank(self.group, prev)}): "
                          f"{e}") from e
        want = self.calls * self.replicas + self.d
        if int(token) != want:
            raise RuntimeError(f"temporal sharing: stage {self.stage} replica {self.d} got {self.direction} "
                               f"WAN token {int(token)}, expected {want}: the data-parallel replicas issue "
                               "different pipeline sends")

    def release(self) -> None:
        self._drain()
        token = torch.tensor([self.calls * self.replicas + self.d + 1], dtype=torch.int64,
                             device=self.device)
        self.pending = [comm.isend(token, (self.d + 1) % self.replicas, self.group)]
        self.calls += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.d == 0 and self.calls > 0:
            self.acquire()       # the token replica D−1 passed after the last send of the ring
        self._drain()

    @property
    def direction(self) -> str:
        return "forward" if self.forward else "backward"

    def _drain(self) -> None:
        pending, self.pending = self.pending, []
        nxt = (self.d + 1) % self.replicas
        try:
            comm.wait_all(pending)
        except comm.CommError as e:
            raise type(e)(f"ATLAS temporal sharing: stage {self.stage} replica {self.d} (rank "
                          f"{dist.get_rank()}) passing the {self.direction} WAN token to replica {nxt} "
                          f"(rank {comm.global_rank(self.group, nxt)}): {e}") from e


class TemporalSharing:
    """Token rings for every WAN boundary of a plan. Collective to build (it creates groups)."""

    def __init__(self, plan: Plan) -> None:
        me = dist.get_rank()
        self.plan = plan
        self._rings: dict[tuple[int, bool], _Ring] = {}
        stage_me, d_me, t_me = plan.coord(me)
        device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                  else torch.device("cpu"))
        if plan.dp == 1:
            return                                   # one sender per boundary: nobody to take turns with
        # A stage sends forward over boundary s -> s+1 and backward over s-1 <- s; one group per ring
        # (new_group is collective: every rank creates every ring's group, in the same order).
        for b in plan.wan_boundaries():
            for s, fwd in ((b, True), (b + 1, False)):
                for t in range(plan.tp):
                    ranks = [plan.rank(s, d, t) for d in range(plan.dp)]
                    name = f"atlas-token(stage{s},tp{t},{'fwd' if fwd else 'bwd'})"
                    group = comm.new_group(ranks, name=name)
                    if (s, t) == (stage_me, t_me):
                        self._rings[(s, fwd)] = _Ring(group, d_me, plan.dp, s, fwd, device)

    def ring(self, me: int, peer: int) -> _Ring | None:
        """The ring a send from ``me`` to ``peer`` takes turns on (None: no sharing needed)."""
        stage, peer_stage = self.plan.coord(me)[0], self.plan.coord(peer)[0]
        return self._rings.get((stage, peer_stage > stage))

    def close(self) -> None:
        """Collect the last token of every ring; idempotent. Every ring is closed even if one fails."""
        errors = []
        for ring in self._rings.values():
            try:
                ring.close()
            except comm.CommError as e:
                errors.append(e)
        if errors:
            raise errors[0]
