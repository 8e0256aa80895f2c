"""Rank candidate layouts by the simulator: branch and bound on :func:`launch.plan.bound.lower_bound`.

Candidates are taken in increasing lower bound and simulated (under each sharing mode offered) until
the next lower bound exceeds the best simulated time. Since no candidate beats its bound, the winner
is the one an exhaustive simulation would pick (ties: fewer GPUs, spatial before temporal, fewer
connections); tests/launch/plan/test_search.py checks the bound against the simulator on every candidate
of the shipped topologies and the pick against exhaustive simulation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from launch.plan.bound import lower_bound
from launch.plan.estimate import Layout, ModelSpec, build, fits, memory
from launch.plan.simulate import Job, Result, simulate
from launch.plan.topology import Topology


@dataclass
class Choice:
    layout: Layout
    job: Job
    result: Result
    bound: float
    memory: float
    candidates: int        # layouts that fit in memory
    simulated: int         # simulations run to find it

    def key(self) -> tuple:
        return _key(self.result.iteration, self.layout)


def _key(iteration: float, lay: Layout) -> tuple:
    return round(iteration, 9), lay.gpus, lay.sharing == "temporal", lay.connections


def best(topo: Topology, model: ModelSpec, layouts: Iterable[Layout], window: float,
         sharings: tuple[str, ...] = ("spatial",)) -> Choice | None:
    """The fastest layout by simulation; a layout that crosses no WAN is simulated once (its sharing
    mode changes nothing), one that does under every mode in ``sharings``. None: nothing fits."""
    pool = []
    for i, lay in enumerate(layouts):
        if fits(topo, model, lay):
            job = build(topo, model, lay, window)
            pool.append((_bound(job, sharings if lay.crosses_wan else (lay.sharing,)), lay.gpus, i, lay, job))
    pool.sort(key=lambda c: c[:3])
    found: Choice | None = None
    runs = 0
    for bound, _, _, lay, job in pool:
        if found is not None and bound > found.result.iteration * (1 + 1e-9):
            break
        for mode in sharings if lay.crosses_wan else (lay.sharing,):
            variant = replace(lay, sharing=mode)
            res = simulate(replace(job, sharing=mode))
            runs += 1
            if found is None or _key(res.iteration, variant) < found.key():
                found = Choice(variant, replace(job, sharing=mode), res, bound, memory(topo, model, variant),
                               len(pool), 0)
    if found is not None:
        found.simulated = runs
    return found


def _bound(job: Job, modes: tuple[str, ...]) -> float:
    """A lower bound under every sharing mode the layout will be simulated in (spatial sharing bounds
    identical replicas as one: launch.plan.deepspeed_schedule.lockstep)."""
    return min(lower_bound(replace(job, sharing=m)) for m in modes)


def exhaustive(topo: Topology, model: ModelSpec, layouts: Iterable[Layout], window: float,
               sharings: tuple[str, ...] = ("spatial",)) -> list[tuple[float, float, Layout]]:
    """(lower bound, simulated seconds, layout) of every candidate and mode: what tests compare with."""
    out = []
    for lay in layouts:
        if not fits(topo, model, lay):
            continue
        job = build(topo, model, lay, window)
        modes = sharings if lay.crosses_wan else (lay.sharing,)
        lb = _bound(job, modes)
        for mode in modes:
            out.append((lb, simulate(replace(job, sharing=mode)).iteration, replace(lay, sharing=mode)))
    return out
