"""The ATLAS plan (:class:`Plan`): what the planner (:mod:`launch.plan.placement`) decides, the
launcher exports to every rank (``ATLAS_PLAN``) and the rank side (:mod:`launch.run.runtime`,
:mod:`launch.net`) reads back: the layout, the stage-to-DC map, the DC-ordered hostfile, the WAN
connections and sharing, the estimate.

Rank layout: pipe is the outermost axis in both DeepSpeed's ``PipeModelDataParallelTopology``
(axes pipe, data, model) and Megatron's default order ``tp-cp-ep-dp-pp``, so with the hostfile in
stage order global rank r sits at stage r // (tp·dp), data (r // tp) % dp, model r % tp, and stage s
occupies the contiguous ranks [s·tp·dp, (s+1)·tp·dp) on hosts of DC(s).
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass

from launch.plan.estimate import Estimate


@dataclass(frozen=True, slots=True)
class PlanHost:
    name: str
    slots: int            # slots used by the plan (a multiple of tp), in rank order
    dc: str
    addr: str | None = None
    ifname: str | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    pp: int
    tp: int
    dp: int
    micro_batches: int
    stage_dc: tuple[str, ...]
    stage_layers: tuple[int, ...]
    hosts: tuple[PlanHost, ...]   # the DC-ordered hostfile
    connections: int
    sharing: str
    estimate: Estimate | None = None
    what_if: tuple[tuple[str, float], ...] = ()
    wan_links: tuple[tuple[str, str, float, float], ...] = ()   # (dc a, dc b, rtt s, bytes/s) crossed

    @property
    def wan_flows(self) -> int:
        """TCP flows one boundary transfer puts on a WAN link: each of the stage's tp ranks sends its
        slice over ``connections`` connections (what the socket buffers must be sized for)."""
        return self.connections * self.tp

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def coord(self, rank: int) -> tuple[int, int, int]:
        """(stage, data, model) of a global rank; DeepSpeed's and Megatron's default order."""
        self._check_rank(rank)
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def rank(self, stage: int, data: int, model: int = 0) -> int:
        return (stage * self.dp + data) * self.tp + model

    def host_of(self, rank: int) -> tuple[PlanHost, int]:
        """The host a rank runs on and its local index there."""
        self._check_rank(rank)
        first = 0
        for h in self.hosts:
            if rank < first + h.slots:
                return h, rank - first
            first += h.slots
        raise AssertionError("hosts cover the world")

    def rank_of(self, host: str, local: int) -> int:
        first = 0
        for h in self.hosts:
            if h.name == host:
                if not 0 <= local < h.slots:
                    raise ValueError(f"plan: host {host!r} runs {h.slots} ranks, no local index {local}")
                return first + local
            first += h.slots
        names = [h.name for h in self.hosts]
        raise ValueError(f"plan: host {host!r} is not used by the plan; hosts: {names}")

    def dc_of(self, rank: int) -> str:
        return self.stage_dc[self.coord(rank)[0]]

    def wan_boundaries(self) -> list[int]:
        """Boundaries s (between stage s and s+1) that cross data centers."""
        return [s for s in range(self.pp - 1) if self.stage_dc[s] != self.stage_dc[s + 1]]

    def wan_pairs(self) -> list[tuple[int, int]]:
        """(rank in stage s, rank in stage s+1) for every pipeline pair that crosses the WAN."""
        return [(self.rank(s, d, t), self.rank(s + 1, d, t))
                for s in self.wan_boundaries() for d in range(self.dp) for t in range(self.tp)]

    def hostfile(self) -> str:
        return "".join(f"{h.name} slots={h.slots}\n" for h in self.hosts)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {self.world_size}")

    # -- travel: the plan goes to every rank as one environment variable ------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        d["stage_dc"], d["stage_layers"] = tuple(d["stage_dc"]), tuple(d["stage_layers"])
        d["hosts"] = tuple(PlanHost(**h) for h in d["hosts"])
        d["estimate"] = Estimate(**d["estimate"]) if d["estimate"] else None
        d["what_if"] = tuple(tuple(w) for w in d["what_if"])
        d["wan_links"] = tuple(tuple(w) for w in d["wan_links"])
        return cls(**d)

    def encode(self) -> str:
        """URL-safe base64 of the JSON (like DeepSpeed's --world_info): no character needs quoting."""
        return base64.urlsafe_b64encode(self.to_json().encode()).decode()

    @classmethod
    def decode(cls, text: str) -> Plan:
        return cls.from_json(base64.urlsafe_b64decode(text.encode()).decode())
