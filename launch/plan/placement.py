"""ATLAS placement (atlas.md §1.4, §1.6): topology + model -> pp/tp/dp, a stage-to-DC map and the
DC-ordered rank layout; ``python -m launch.plan TOPOLOGY`` prints it.

Algorithm 1 (as reimplemented by SAILOR, ``eth-easl/sailor`` atlas_planner.py): sort the data
centers by free GPUs, largest first; give each in turn as many *whole* stages (tp·dp GPUs each) as
it holds, consecutive stages to the same DC, until pp stages are placed. Pipeline stages therefore
cross the WAN and every stage's DP and TP ranks stay inside one DC. Around it, SAILOR's search over
every (pp, tp, dp), widened here (:func:`placements`): the fill in every order of the DCs and every
order of the used DCs along the pipeline (link bandwidth and latency decide it with 3+ DCs); layers
in proportion to each stage's GPU speed (``gpu_tflops``) within its memory; the number of TCP
connections (:func:`fill_connections`) chosen with the layout, the sharing mode as :data:`SHARINGS` says
(spatial unless asked: temporal sharing is unvalidated). Every candidate is ranked by the discrete-event
simulator running the engine's own call order (:data:`ENGINES`: DeepSpeed's by default, the executor the
calibration checks against real runs; :mod:`launch.plan.search`: branch and bound on a proven lower
bound, so none that could win is skipped); the fastest iteration wins, fewer
GPUs on a tie. That choice is also how ATLAS "picks how many GPUs to use in each DC". Nothing here
reads this machine's sysctls: a WAN connection's window is the topology's ``window_mb`` or Linux's
default (launch.plan.socket_limits.DEFAULT_WINDOW); the launcher reports local TCP settings as warnings only.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise, permutations

from commweave import values
from launch.plan.estimate import Estimate, Layout, ModelSpec, build, layer_caps, link_window, split_layers
from launch.plan.plan import Plan, PlanHost
from launch.plan.search import Choice, best
from launch.plan.simulate import simulate
from launch.plan.socket_limits import DEFAULT_WINDOW, NCCL_MAX_SOCKETS, nccl_split
from launch.plan.topology import Topology, check_model


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


def placements(topo: Topology, pp: int, tp: int, dp: int) -> list[tuple[str, ...]]:
    """Stage-to-DC maps for pp stages of tp·dp GPUs: Algorithm 1's whole-stage greedy fill, in every
    order of the data centers (Algorithm 1's own, largest first, is one of them; another order lets a
    smaller but faster DC come first), and for each, every order of the used DCs along the pipeline
    (with three or more DCs the order decides which WAN links the pipeline crosses). Beyond 4 DCs only
    Algorithm 1's fill and its order. The simulator chooses among them."""
    names = topo.dc_names
    by_size = sorted(names, key=lambda d: -usable_gpus(topo, d, tp))   # Algorithm 1's order, first:
    fills = [tuple(by_size)]                                           # it wins ties (search.py)
    if len(names) <= 4:
        fills += [p for p in permutations(by_size) if list(p) != by_size]
    seen, out = set(), []
    for order in fills:
        left, counts = pp, {}
        for d in order:
            k = min(left, usable_gpus(topo, d, tp) // (tp * dp))
            if k:
                counts[d] = k
            left -= k
        if left:
            continue
        used = list(counts)                  # in fill order, so the fill's own chain comes first
        for chain in permutations(used) if len(used) <= 4 else [used]:
            stage_dc = tuple(d for d in chain for _ in range(counts[d]))
            if stage_dc not in seen:
                seen.add(stage_dc)
                out.append(stage_dc)
    return out


def fill_connections(topo: Topology, stage_dc: tuple[str, ...], tp: int, window: float) -> int:
    """The fewest TCP connections per WAN rank pair with which one boundary transfer (tp ranks in
    parallel) fills every WAN link the pipeline crosses: ceil(B·RTT / (tp·window)), at most NCCL's 64
    sockets (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD, atlas.md §2.1). More never helps (the
    link is full), fewer leave a lone transfer below the link rate; 1 when nothing crosses."""
    need = 1
    for a, b in pairwise(stage_dc):
        if a != b:
            w = topo.link(a, b)
            need = max(need, math.ceil(w.bandwidth * w.rtt / (tp * link_window(w, window)) - 1e-9))
    return min(need, NCCL_MAX_SOCKETS)


# How DP replicas share a WAN direction. The default is spatial (stock TCP: all at once): the calibration
# matrix on the emulated WAN (benchmarks.atlas_calibration; README "The simulator against real runs")
# never measured temporal sharing paying (spatial/temporal 0.75-1.00x over its eight groups), while this
# search's idealised 1F1B model predicts temporal gains (up to 1.19x on the shipped topologies) that no
# run backs. "temporal" forces it and "auto" lets the simulator pick the faster of the two: both are
# opt-ins whose gain is a model's, unvalidated. The connection count needs no opt-in: the matrix measured
# 8 connections 1.9-2.9x faster than one with 1 MiB transfers on a window-limited link.
SHARINGS = ("spatial", "temporal", "auto")
# The engine whose call order the planner ranks ATLAS's layouts by (launch.plan.deepspeed_schedule: the
# model the calibration matrix checked against real runs): deepspeed-atlas launches DeepSpeed's pipeline
# engine; "megatron" for a Megatron-LM script (launch.run.runtime.enable_megatron).
ENGINES = ("deepspeed", "megatron")
DEFAULT_ENGINE = "deepspeed"
DEFAULT_SHARING = "spatial"
UNVALIDATED = "unvalidated: the calibration matrix never measured temporal sharing paying"


def sharing_modes(sharing: str, name: str = "sharing") -> tuple[str, ...]:
    """The sharing modes the search simulates for ``sharing`` (one of :data:`SHARINGS`)."""
    values.choice(sharing, name, SHARINGS)
    return ("spatial", "temporal") if sharing == "auto" else (sharing,)


# The search simulates candidates of every (pp, tp, dp) with pp·tp·dp <= the GPUs offered, each under
# several placements: about 5 ms per combination on the shipped topologies (three_dc: 190 in ~1 s).
# Beyond this many combinations (10**9 slots, 10**7 layers) the model section must fix pp, tp or dp.
MAX_DEGREES = 2000


def tp_options(topo: Topology, model: ModelSpec) -> list[int]:
    """TP degrees: the model's, else every divisor of the largest host (a TP group never spans hosts)."""
    max_slots = max(h.slots for h in topo.hosts)
    return [model.tp] if model.tp else [t for t in range(1, max_slots + 1) if max_slots % t == 0]


def degrees(topo: Topology, model: ModelSpec, tps: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Every (pp, tp, dp) the model section allows with pp·tp·dp <= the topology's GPUs (dp divides the
    sequences per iteration); a ValueError when there are more than :data:`MAX_DEGREES`."""
    total = sum(h.slots for h in topo.hosts)
    tps = tp_options(topo, model) if tps is None else tps
    pps = [model.pp] if model.pp else range(1, min(model.layers, total) + 1)
    dps = [model.dp] if model.dp else [d for d in range(1, min(model.sequences, total) + 1)
                                       if model.sequences % d == 0]
    count = sum(1 for tp in tps for pp in pps if pp * tp <= total for dp in dps if pp * tp * dp <= total)
    if count > MAX_DEGREES:
        values.refuse(f"{topo.source}: model", {"layers": model.layers, "sequences": model.sequences,
                                                 "gpus": total},
                      f"{count} (pp, tp, dp) combinations to search, more than {MAX_DEGREES} (about 10 s): "
                      "fix pp, tp or dp in the model section")
    return [(pp, tp, dp) for tp in tps for pp in pps for dp in dps if pp * tp * dp <= total]


def atlas_layouts(topo: Topology, model: ModelSpec, window: float, connections: int | None = None,
                  split=None, engine: str = DEFAULT_ENGINE):
    """ATLAS's candidates: every (pp, tp, dp) the model section allows, every placement, layers in
    proportion to the stages' GPU speed within their memory, connections chosen per placement, run by
    ``engine``'s schedule (:data:`ENGINES`).
    ``split(layers, speeds, caps)``: another layer split rule (the decomposition's baseline splits)."""
    split = split or split_layers
    for pp, tp, dp in degrees(topo, model):
        for stage_dc in placements(topo, pp, tp, dp):
            speeds = [topo.dc(d).gpu_flops for d in stage_dc]
            caps = layer_caps(topo, model, list(stage_dc), tp, dp)
            layers = split(model.layers, speeds, caps)
            if layers is None:
                continue
            conns = connections or fill_connections(topo, stage_dc, tp, window)
            yield Layout(tp, tuple((d,) * dp for d in stage_dc), tuple(layers), conns, "spatial",
                         atlas_runtime=True, schedule=engine)


def choose(topo: Topology, model: ModelSpec, connections: int | None = None,
           sharing: str = DEFAULT_SHARING, window: float = DEFAULT_WINDOW,
           engine: str = DEFAULT_ENGINE) -> Choice:
    """ATLAS's layout: the simulator's fastest candidate (launch.plan.search) under ``engine``'s schedule,
    the number of connections chosen with it unless fixed here, the sharing mode as ``sharing`` says
    (:data:`SHARINGS`)."""
    sharings = sharing_modes(sharing)
    values.choice(engine, "engine", ENGINES)
    if connections is not None:
        nccl_split(connections)  # the same limits as the launcher: 1..64 connections
    if model.dp and model.sequences % model.dp:
        raise ValueError(f"model.dp={model.dp}: global_batch/micro_batch = {model.sequences} sequences per "
                         "iteration must divide by dp")
    found = best(topo, model, atlas_layouts(topo, model, window, connections, engine=engine), window,
                 sharings)
    if found is None:
        raise ValueError(_infeasible(topo, model))
    return found


def make_plan(topo: Topology, model: ModelSpec, connections: int | None = None,
              sharing: str = DEFAULT_SHARING, window: float | None = None,
              engine: str = DEFAULT_ENGINE) -> Plan:
    """Search (pp, tp, dp), placement and connections; keep the simulator's fastest layout.

    ``connections`` fixes that choice (None: the planner picks it); ``sharing`` is one of :data:`SHARINGS`
    (spatial by default; "auto": the simulator picks, unvalidated); ``window`` is one
    TCP connection's window on WAN links without ``window_mb`` (default: Linux's default buffers,
    launch.plan.socket_limits.DEFAULT_WINDOW) — never this machine's sysctls, which only produce warnings;
    ``engine`` is the training engine whose schedule the layouts are ranked by (:data:`ENGINES`)."""
    window = DEFAULT_WINDOW if window is None else window
    return plan_of(topo, model, choose(topo, model, connections, sharing, window, engine), window)


def layout_of(plan: Plan, engine: str = DEFAULT_ENGINE) -> Layout:
    """A plan's layout, as the simulator takes it (launch.plan.estimate.build), run by ``engine``'s
    schedule (the one :func:`make_plan` ranked it by; DeepSpeed's by default)."""
    return Layout(plan.tp, tuple((d,) * plan.dp for d in plan.stage_dc), plan.stage_layers, plan.connections,
                  plan.sharing, atlas_runtime=True, schedule=engine)


def plan_of(topo: Topology, model: ModelSpec, found: Choice, window: float) -> Plan:
    lay, res = found.layout, found.result
    stage_dc = [s[0] for s in lay.dc]
    est = Estimate(res.iteration, found.bound, True, res.utilisation, found.memory)
    plan = Plan(lay.pp, lay.tp, lay.dp, model.micro_batches(lay.dp), tuple(stage_dc), lay.stage_layers,
                tuple(assign_hosts(topo, stage_dc, lay.tp, lay.dp)), lay.connections, lay.sharing, est)
    links = [topo.link(stage_dc[s], stage_dc[s + 1]) for s in plan.wan_boundaries()]
    return replace(plan, what_if=_what_if(topo, model, lay, window),
                   wan_links=tuple((w.a, w.b, w.rtt, w.bandwidth) for w in links))


def _what_if(topo: Topology, model: ModelSpec, lay: Layout, window: float) -> tuple[tuple[str, float], ...]:
    """The same layout under the other sharing mode and with a single TCP connection (a temporal
    variant is labelled unvalidated: the idealised model's figure, which no measurement backs)."""
    if not lay.crosses_wan:
        return ()
    other = "spatial" if lay.sharing == "temporal" else "temporal"
    mark = {"temporal": " (unvalidated)", "spatial": ""}
    variants = [(f"{other} sharing{mark[other]}", lay.connections, other),
                (f"1 connection{mark[lay.sharing]}", 1, lay.sharing),
                (f"1 connection, {other} sharing{mark[other]}", 1, other)]
    return tuple((label, simulate(build(topo, model, replace(lay, connections=k, sharing=mode),
                                        window)).iteration) for label, k, mode in variants)


def _infeasible(topo: Topology, model: ModelSpec) -> str:
    fixed = {k: getattr(model, k) for k in ("pp", "tp", "dp") if getattr(model, k)}
    offer = ", ".join(f"{d.name}: {d.gpus}" for d in topo.datacenters)
    # the least memory a placeable layout needs: even layers, stage 0's in-flight micro-batches
    need = [model.stage_memory(-(-model.layers // pp), min(pp, model.micro_batches(dp)), tp)
            for pp, tp, dp in degrees(topo, model) if place(topo, pp, tp, dp) is not None]
    if not need:
        want = ""
        if len(fixed) == 3:
            want = (f"pp={model.pp} stages of tp x dp = {model.tp * model.dp} GPUs "
                    f"({model.pp * model.tp * model.dp} GPUs, whole stages per data center) ")
        return (f"{topo.source}: too few GPUs for the plan: {want or f'fixed {fixed} '}cannot be placed; "
                f"the data centers offer {offer} GPUs (tp groups never span hosts, stages never span "
                "data centers)")
    return (f"{topo.source}: too few GPUs for the plan: the smallest layout needs {min(need) / 2**30:.1f} "
            f"GiB per GPU, more than the data centers' GPUs hold; offered GPUs {offer}"
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
        how = f"simulated; lower bound {e.lower_bound:.4g} s" if e.simulated else "lower bound"
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
        raw = values.load_json(model_file, "--atlas-model", top=dict)
        raw = raw.get("model", raw)
        if not isinstance(raw, dict):
            values.refuse("--atlas-model", model_file, "its \"model\" must be a JSON object")
        return ModelSpec.from_dict(check_model(raw, f"{model_file}: model"), source=model_file)
    if topo.model is None:
        raise ValueError(f"{topo.source}: no \"model\" section; add one or pass --atlas-model FILE")
    return ModelSpec.from_dict(topo.model, source=f"{topo.source}: model")
