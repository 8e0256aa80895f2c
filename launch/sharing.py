"""Temporal WAN sharing (mechanism C, atlas.md §1.5): the D data-parallel senders of a WAN boundary
take turns, so each transfer has the whole link instead of 1/D of it.

Spatial sharing (stock TCP): D pipelines push their micro-batch at once, each at about B/D; the last
byte lands when it would have anyway, but every pipeline's next stage waits for the slowest.
Temporal sharing: a token goes round the D senders of one boundary and direction in the order
(micro-batch, then replica): (0,0), (0,1), ..., (0,D−1), (1,0), ...; a sender sends only while it
holds the token and passes it on when its transfer has completed. The first replicas' far stages
start a transfer-time earlier and overlap the later transfers with compute.

Realisation: one ring per (stage, direction, tensor-parallel index) over the D replicas of that
stage (they sit in one DC, so the tiny token messages stay off the WAN), on that stage's data-parallel
group. Every replica issues the same sequence of WAN sends (same schedule, same shapes), so the
token order is (send call, replica); the token carries its sequence number and a replica that
receives the wrong one raises instead of silently reordering. The ring never stops between
iterations; :meth:`TemporalSharing.close` collects the one token still travelling to replica 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commweave import comm
from launch.plan import Plan

_TAG = {True: 1, False: 2}      # forward-direction ring, backward-direction ring (same group)


@dataclass
class _Ring:
    group: object
    d: int                     # this replica's index = its rank in the ring group
    replicas: int
    tag: int
    device: torch.device           # where the token lives: NCCL sends only device tensors
    calls: int = 0             # WAN sends this replica has made on this ring
    pending: list = field(default_factory=list)

    def acquire(self) -> None:
        if self.calls == 0 and self.d == 0:
            return                                   # replica 0 holds the first token
        token = torch.zeros(1, dtype=torch.int64, device=self.device)
        comm.recv(token, (self.d - 1) % self.replicas, self.group, tag=self.tag)
        want = self.calls * self.replicas + self.d
        if int(token) != want:
            raise RuntimeError(f"temporal sharing: replica {self.d} got WAN token {int(token)}, expected "
                               f"{want}: the data-parallel replicas issue different pipeline sends")

    def release(self) -> None:
        comm.wait_all(self.pending)
        token = torch.tensor([self.calls * self.replicas + self.d + 1], dtype=torch.int64,
                             device=self.device)
        self.pending = [comm.isend(token, (self.d + 1) % self.replicas, self.group, tag=self.tag)]
        self.calls += 1

    def close(self) -> None:
        if self.d == 0 and self.calls > 0:
            self.acquire()       # the token replica D−1 passed after the last send of the ring
        comm.wait_all(self.pending)
        self.pending = []


class TemporalSharing:
    """Token rings for every WAN boundary of a plan. Collective to build (it creates groups)."""

    def __init__(self, plan: Plan) -> None:
        me = dist.get_rank()
        self.plan = plan
        self._rings: dict[tuple[int, bool], _Ring] = {}
        stage_me, d_me, t_me = plan.coord(me)
        device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                  else torch.device("cpu"))
        wan = set(plan.wan_boundaries())
        # stages that send across a boundary: s sends forward over s -> s+1, s+1 sends backward.
        senders = sorted({s for s in wan} | {s + 1 for s in wan})
        for s in senders:
            for t in range(plan.tp):
                ranks = [plan.rank(s, d, t) for d in range(plan.dp)]
                group = comm.new_group(ranks, name=f"atlas-token(stage{s},tp{t})")  # collective
                if (s, t) != (stage_me, t_me) or plan.dp == 1:
                    continue
                for fwd in (True, False):
                    if (s if fwd else s - 1) in wan:
                        self._rings[(s, fwd)] = _Ring(group, d_me, plan.dp, _TAG[fwd], device)

    def ring(self, me: int, peer: int) -> _Ring | None:
        """The ring a send from ``me`` to ``peer`` takes turns on (None: no sharing needed)."""
        stage, peer_stage = self.plan.coord(me)[0], self.plan.coord(peer)[0]
        return self._rings.get((stage, peer_stage > stage))

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
