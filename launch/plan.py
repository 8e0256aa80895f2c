"""ATLAS placement (atlas.md §1.4, §1.6): topology + model -> pp/tp/dp, a stage-to-DC map and the
DC-ordered rank layout; ``python -m launch.plan TOPOLOGY`` prints it.

Algorithm 1 (as reimplemented by SAILOR, ``eth-easl/sailor`` atlas_planner.py): sort the data
centers by free GPUs, largest first; give each in turn as many *whole* stages (tp·dp GPUs each) as
it holds, consecutive stages to the same DC, until pp stages are placed. Pipeline stages therefore
cross the WAN and every stage's DP and TP ranks stay inside one DC. Around it, SAILOR's search:
every (pp, tp, dp) whose layout places and fits in memory is scored by :mod:`launch.estimate`
(closed form for all, the discrete-event simulator for the best few); the fastest iteration wins,
fewer GPUs on a tie. That choice is also how ATLAS "picks how many GPUs to use in each DC".

Rank layout: pipe is the outermost axis in both DeepSpeed's ``PipeModelDataParallelTopology``
(axes pipe, data, model) and Megatron's default order ``tp-cp-ep-dp-pp``, so with the hostfile in
stage order global rank r sits at stage r // (tp·dp), data (r // tp) % dp, model r % tp, and stage s
occupies the contiguous ranks [s·tp·dp, (s+1)·tp·dp) on hosts of DC(s).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from launch import topology as topology_mod
from launch.estimate import Estimate, ModelSpec, estimate, stage_layers
from launch.sockets import host_window, nccl_split
from launch.topology import Topology

SIMULATE_TOP = 8          # candidates re-scored by the simulator after the closed-form ranking
SIMULATE_MAX_OPS = 200_000  # skip the simulator beyond this many ops (pp·dp·M·2); closed form only


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


def usable_gpus(topo: Topology, dc: str, tp: int) -> int:
    """GPUs of a DC that can hold whole TP groups (a TP group never spans hosts)."""
    return sum(h.slots // tp * tp for h in topo.dc(dc).hosts)


def place(topo: Topology, pp: int, tp: int, dp: int) -> list[str] | None:
    """Algorithm 1: the stage-to-DC map, or None when the DCs cannot hold pp whole stages."""
    order = sorted(topo.dc_names, key=lambda d: -usable_gpus(topo, d, tp))  # stable: file order on ties
    left, stage_dc = pp, []
    for d in order:
        k = min(left, usable_gpus(topo, d, tp) // (tp * dp))
        stage_dc += [d] * k
        left -= k
        if left == 0:
            return stage_dc
    return None


def assign_hosts(topo: Topology, stage_dc: list[str], tp: int, dp: int) -> list[PlanHost]:
    """The DC-ordered hostfile: for each DC in stage order, its hosts in file order, tp-aligned."""
    out = []
    for dc_name in dict.fromkeys(stage_dc):
        dc = topo.dc(dc_name)
        need = stage_dc.count(dc_name) * tp * dp
        for h in dc.hosts:
            take = min(need, h.slots // tp * tp)
            if take:
                out.append(PlanHost(h.name, take, dc_name, h.addr, dc.ifname))
            need -= take
        assert need == 0, "place() checked the capacity"
    return out


def make_plan(topo: Topology, model: ModelSpec, connections: int = 8, sharing: str = "temporal",
              window: float | None = None) -> Plan:
    """Search (pp, tp, dp), place with Algorithm 1, keep the fastest estimated layout."""
    if sharing not in ("temporal", "spatial"):
        raise ValueError(f"sharing={sharing!r}: use 'temporal' or 'spatial'")
    nccl_split(connections)  # the same limits as the launcher: 1..64 connections
    window = host_window() if window is None else window
    max_slots = max(h.slots for h in topo.hosts)
    sequences = model.global_batch // model.micro_batch
    tps = [model.tp] if model.tp else [t for t in range(1, max_slots + 1) if max_slots % t == 0]
    pps = [model.pp] if model.pp else range(1, model.layers + 1)
    dps = [model.dp] if model.dp else [d for d in range(1, sequences + 1) if sequences % d == 0]
    if model.dp and sequences % model.dp:
        raise ValueError(f"model.dp={model.dp}: global_batch/micro_batch = {sequences} sequences per "
                         "iteration must divide by dp")
    total = sum(h.slots for h in topo.hosts)
    scored, placed_any, smallest_mem = [], False, math.inf
    for tp in tps:
        for pp in pps:
            for dp in dps:
                if pp * tp * dp > total:
                    continue
                stage_dc = place(topo, pp, tp, dp)
                if stage_dc is None:
                    continue
                placed_any = True
                est = estimate(topo, model, stage_dc, tp, dp, connections, sharing, window, False)
                capacity = min(topo.dc(d).gpu_memory for d in set(stage_dc))
                smallest_mem = min(smallest_mem, est.memory)
                if est.memory <= capacity:
                    scored.append((est.iteration, pp * tp * dp, pp, tp, dp, stage_dc))
    if not scored:
        raise ValueError(_infeasible(topo, model, tps, placed_any, smallest_mem))
    scored.sort(key=lambda c: (c[0], c[1]))
    best = None
    for _, _, pp, tp, dp, stage_dc in scored[:SIMULATE_TOP]:
        sim = 2 * pp * dp * model.micro_batches(dp) <= SIMULATE_MAX_OPS
        est = estimate(topo, model, stage_dc, tp, dp, connections, sharing, window, sim)
        if best is None or (est.iteration, pp * tp * dp) < (best[0].iteration, best[1] * best[2] * best[3]):
            best = (est, pp, tp, dp, stage_dc)
    est, pp, tp, dp, stage_dc = best
    plan = Plan(pp, tp, dp, model.micro_batches(dp), tuple(stage_dc),
                tuple(stage_layers(model.layers, pp)), tuple(assign_hosts(topo, stage_dc, tp, dp)),
                connections, sharing, est)
    links = [topo.link(stage_dc[s], stage_dc[s + 1]) for s in plan.wan_boundaries()]
    return replace(plan, what_if=_what_if(topo, model, plan, window),
                   wan_links=tuple((w.a, w.b, w.rtt, w.bandwidth) for w in links))


def _what_if(topo: Topology, model: ModelSpec, plan: Plan, window: float) -> tuple[tuple[str, float], ...]:
    """The same layout under the other sharing mode and with a single TCP connection."""
    if not plan.wan_boundaries():
        return ()
    sim = plan.estimate.simulated
    other = "spatial" if plan.sharing == "temporal" else "temporal"
    variants = [(f"{other} sharing", plan.connections, other),
                ("1 connection", 1, plan.sharing), (f"1 connection, {other} sharing", 1, other)]
    return tuple((label, estimate(topo, model, list(plan.stage_dc), plan.tp, plan.dp, conns, sharing,
                                  window, sim).iteration) for label, conns, sharing in variants)


def _infeasible(topo: Topology, model: ModelSpec, tps: list[int], placed_any: bool, mem: float) -> str:
    fixed = {k: getattr(model, k) for k in ("pp", "tp", "dp") if getattr(model, k)}
    offer = ", ".join(f"{d.name}: {d.gpus}" for d in topo.datacenters)
    if not placed_any:
        want = ""
        if len(fixed) == 3:
            want = (f"pp={model.pp} stages of tp x dp = {model.tp * model.dp} GPUs "
                    f"({model.pp * model.tp * model.dp} GPUs, whole stages per data center) ")
        return (f"{topo.source}: too few GPUs for the plan: {want or f'fixed {fixed} '}cannot be placed; "
                f"the data centers offer {offer} GPUs (tp groups never span hosts, stages never span "
                "data centers)")
    return (f"{topo.source}: too few GPUs for the plan: the smallest layout needs {mem / 2**30:.1f} GiB "
            f"per GPU, more than the data centers' GPUs hold; offered GPUs {offer}"
            + (f" with fixed {fixed}" if fixed else ""))


def render(plan: Plan, topo: Topology, model: ModelSpec) -> str:
    """The plan as a person reads it."""
    lines = [f"ATLAS plan for {topo.source}",
             f"  model    {model.layers} layers, hidden {model.hidden}, seq {model.seq}, "
             f"global batch {model.global_batch} = {plan.dp} replicas x {plan.micro_batches} "
             f"micro-batches x {model.micro_batch}",
             f"  layout   pp={plan.pp} tp={plan.tp} dp={plan.dp}: {plan.world_size} of "
             f"{sum(h.slots for h in topo.hosts)} GPUs ("
             + ", ".join(f"{d.name} {sum(h.slots for h in plan.hosts if h.dc == d.name)}/{d.gpus}"
                         for d in topo.datacenters) + ")",
             "  stage  dc            layers  ranks          hosts"]
    for s in range(plan.pp):
        lo, hi = plan.rank(s, 0, 0), plan.rank(s, plan.dp - 1, plan.tp - 1)
        hosts = dict.fromkeys(plan.host_of(r)[0].name for r in range(lo, hi + 1))
        lines.append(f"  {s:<5}  {plan.stage_dc[s]:<12}  {plan.stage_layers[s]:<6}  "
                     f"{f'{lo}-{hi}':<13}  {' '.join(hosts)}")
    for s in plan.wan_boundaries():
        w = topo.link(plan.stage_dc[s], plan.stage_dc[s + 1])
        lines.append(f"  WAN      stage {s} -> {s + 1}: {plan.stage_dc[s]} <-> {plan.stage_dc[s + 1]}, "
                     f"{w.rtt * 1e3:g} ms RTT, {w.bandwidth * 8 / 1e9:g} Gb/s; "
                     f"{model.act_bytes / 2**20:.2f} MiB per micro-batch each way; "
                     f"{plan.connections} TCP connections per pair, {plan.sharing} sharing")
    if not plan.wan_boundaries():
        lines.append("  WAN      not crossed (the plan fits in one data center)")
    e = plan.estimate
    if e is not None:
        how = f"simulated; closed form {e.analytic:.4g} s" if e.simulated else "closed form"
        lines.append(f"  estimate {e.iteration:.4g} s per iteration ({how}), GPU utilisation "
                     f"{100 * e.utilisation:.0f}%, peak memory {e.memory / 2**30:.2f} GiB per GPU")
    for label, t in plan.what_if:
        lines.append(f"  what-if  {label}: {t:.4g} s per iteration")
    lines.append("  hostfile (DC order = stage order):")
    lines += [f"    {line}" for line in plan.hostfile().splitlines()]
    return "\n".join(lines)


def load_model(topo: Topology, model_file: str | None) -> ModelSpec:
    """The model section: from --atlas-model FILE when given, else the topology file's "model"."""
    if model_file:
        try:
            raw = json.loads(Path(model_file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--atlas-model {model_file!r}: cannot read a JSON object ({e})") from None
        return ModelSpec.from_dict(raw.get("model", raw), source=model_file)
    if topo.model is None:
        raise ValueError(f"{topo.source}: no \"model\" section; add one or pass --atlas-model FILE")
    return ModelSpec.from_dict(topo.model, source=f"{topo.source}: model")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.splitlines()[0])
    ap.add_argument("topology", help="the ATLAS topology file (JSON)")
    ap.add_argument("--atlas-model", default=None, help="JSON with the model section (else the topology's)")
    ap.add_argument("--wan-connections", type=int, default=8, help="TCP connections per WAN pair")
    ap.add_argument("--sharing", choices=("temporal", "spatial"), default="temporal")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--bubbletea", action="store_true", help="add the utilisation with BubbleTea's prefill")
    args = ap.parse_args(argv)
    try:
        topo = topology_mod.load(args.topology)
        model = load_model(topo, args.atlas_model)
        plan = make_plan(topo, model, args.wan_connections, args.sharing)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else render(plan, topo, model))
    if args.bubbletea:
        from launch.bubbletea.simulate import for_plan, render_line

        bt = for_plan(topo, model, plan)
        if not args.json:
            print(render_line(bt))
        print(json.dumps({"iteration_s": bt.iteration, "utilisation": bt.utilisation_training,
                          "utilisation_bubbletea": bt.utilisation}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
