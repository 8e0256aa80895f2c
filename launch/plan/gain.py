"""Where ATLAS's gain over the baselines comes from, on one topology, by the same simulator.

The baselines (launch.plan.baselines) get the freedom of their own systems; ATLAS differs from the best
of them in its engine and four mechanisms, added one at a time, each step the simulator's best layout with the
mechanisms so far (the same branch-and-bound search, launch.plan.search):

    T0  the best baseline anywhere (its own placements, GPUs and layer split, 1 connection, spatial,
          its own engine's schedule: launch.plan.baselines.SCHEDULES)
    T0' + engine: the same system's layouts run by the schedule of ATLAS's engine (DeepSpeed's by
          default: what deepspeed-atlas launches); 1.00x when the best baseline runs that engine too,
          below 1.00x where the baseline's engine overlaps its transfers better (Megatron's combined
          send+recv calls against DeepSpeed's one-at-a-time ones)
    T1  + placement: ATLAS's whole stages per data center (Algorithm 1's fill in every DC order, every
          order of the used DCs) with any pp/tp/dp, the best baseline's layer split, 1 connection, spatial
          (from here on every step runs ATLAS's engine's schedule)
    T2  + layer split: layers in proportion to the stages' GPU speed within their memory
    T3  + connections: the TCP connections per WAN pair that fill the links (ATLAS's choice per layout)
    T4  + sharing: ATLAS's plan, with the sharing mode the planner was given: spatial by default, so
          this step is 1.00x (temporal sharing never paid in the calibration matrix and is chosen only
          on request, ``--sharing temporal|auto``: then this step is the model's, unvalidated)

Each step's ratio is T(k−1)/T(k), so the product is T0/T4, ATLAS's gain over the best baseline. A step
below 1.00x says the mechanism costs time there (a search that is not nested: a baseline placement that
ATLAS's whole-stage rule cannot express, or more connections that fill memory).

:func:`same_gpus` compares ATLAS with each baseline restricted to ATLAS's own GPUs (the hosts and slots its
plan uses, all of them): what the planner's layout is worth once the GPU set is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launch.plan import baselines
from launch.plan.estimate import ModelSpec
from launch.plan.placement import atlas_layouts
from launch.plan.plan import Plan
from launch.plan.search import Choice, best
from launch.plan.topology import Topology

ENGINE_NAMES = {"deepspeed": "DeepSpeed", "megatron": "Megatron"}
SPLITS = {"deepspeed": baselines.even_split, "megatron": baselines.megatron_split,
          "varuna": baselines.even_split, "dp-wan": baselines.even_split}


@dataclass(frozen=True)
class Step:
    label: str
    seconds: float | None     # the step's best iteration time (None: no layout fits)
    ratio: float | None       # previous step's seconds / this one's


def compare(topo: Topology, model: ModelSpec, window: float, gpus: int | None = None
            ) -> dict[str, Choice | None]:
    """Each baseline's fastest layout by simulation under its own engine's schedule (None: it has none);
    ``gpus``: only layouts on exactly that many GPUs."""
    out = {}
    for name, layouts in baselines.LAYOUTS.items():
        lays = (lay for lay in layouts(topo, model) if gpus is None or lay.gpus == gpus)
        out[name] = best(topo, model, lays, window)
    return out


def best_of(choices: dict[str, Choice | None]) -> tuple[str, Choice] | None:
    """The fastest baseline; on a tie the first of :data:`launch.plan.baselines.LAYOUTS`."""
    known = [(c.key(), i, name, c) for i, (name, c) in enumerate(choices.items()) if c is not None]
    return min(known)[2:] if known else None


def decompose(topo: Topology, model: ModelSpec, atlas: Choice, others: dict[str, Choice | None],
              window: float, gpus: int | None = None) -> list[Step]:
    """T0..T4 of the module docstring (empty when no baseline has a layout); ``gpus``: every step on
    exactly that many GPUs (with ``topo`` cut down to ATLAS's plan: the same-GPU-set decomposition)."""
    top = best_of(others)
    if top is None:
        return []
    name, base = top
    engine = atlas.layout.schedule

    def fastest(**kw) -> Choice | None:
        lays = atlas_layouts(topo, model, window, engine=engine, **kw)
        return best(topo, model, (lay for lay in lays if gpus is None or lay.gpus == gpus), window)

    same_engine = base if baselines.SCHEDULES[name] == engine else best(
        topo, model, (replace(lay, schedule=engine) for lay in baselines.LAYOUTS[name](topo, model)
                      if gpus is None or lay.gpus == gpus), window)
    placed = fastest(connections=1, split=SPLITS[name])
    one_conn = fastest(connections=1)
    conns = fastest()
    times = [(f"best baseline: {baselines.NAMES[name]}", base),
             (f"+ engine ({ENGINE_NAMES[engine]}'s schedule)", same_engine),
             ("+ placement (ATLAS's stages per DC)", placed),
             ("+ layer split (by GPU speed)", one_conn), ("+ TCP connections", conns),
             (f"+ sharing ({atlas.layout.sharing}) = ATLAS", atlas)]
    steps, prev = [], None
    for label, c in times:
        t = c.result.iteration if c is not None else None
        steps.append(Step(label, t, prev / t if prev and t else None))
        prev = t
    return steps


def plan_topology(topo: Topology, plan: Plan) -> Topology:
    """The topology cut down to the hosts and slots ``plan`` uses (its GPU set)."""
    used = {h.name: h.slots for h in plan.hosts}
    dcs = []
    for dc in topo.datacenters:
        hosts = tuple(replace(h, slots=used[h.name]) for h in dc.hosts if h.name in used)
        if hosts:
            dcs.append(replace(dc, hosts=hosts))
    names = {d.name for d in dcs}
    return replace(topo, datacenters=tuple(dcs), wan=tuple(w for w in topo.wan if {w.a, w.b} <= names))


def same_gpus(topo: Topology, model: ModelSpec, plan: Plan, atlas: Choice, window: float
              ) -> tuple[dict[str, Choice | None], list[Step]]:
    """Each baseline's fastest layout on exactly ATLAS's GPUs, and the decomposition there."""
    sub = plan_topology(topo, plan)
    others = compare(sub, model, window, gpus=plan.world_size)
    return others, decompose(sub, model, atlas, others, window, gpus=plan.world_size)
