"""The planner's lower bound: never above the simulator (so branch and bound loses no candidate),
exact where the pipeline has no communication, and tight where 1F1B stalls on a WAN round trip."""

import random

import pytest

from launch.plan import topology
from launch.plan.bound import lower_bound
from launch.plan.estimate import Layout, ModelSpec, build
from launch.plan.simulate import Collective, Job, Route, WanFlow, simulate


def _random_job(rng: random.Random) -> Job:
    S, D, M = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 9)
    speed = [[rng.choice([1.0, 1.0, 1.5, 3.0]) for _ in range(D)] for _ in range(S)]
    t_f = tuple(tuple(rng.uniform(0.5, 1.5) * speed[s][d] for d in range(D)) for s in range(S))
    t_b = tuple(tuple(2 * t_f[s][d] * rng.uniform(0.8, 1.2) for d in range(D)) for s in range(S))
    wan = {("a", "b"): (rng.uniform(0.5, 4.0), rng.uniform(0.2, 2.0)),
           ("b", "c"): (rng.uniform(0.5, 4.0), rng.uniform(0.2, 2.0))}
    dcs = [rng.choice("abc") for _ in range(S)]
    routes = []
    for e in range(S - 1):
        row = []
        for _ in range(D):
            pair = tuple(sorted((dcs[e], dcs[e + 1])))
            if dcs[e] != dcs[e + 1] and pair in wan and rng.random() < 0.8:
                bw, cap = wan[pair]
                latency = rng.choice([0.1, 0.5, 2.0])
                row.append(Route(latency, bw, (dcs[e], dcs[e + 1]), rng.randint(1, 4), cap))
            else:
                row.append(Route(rng.uniform(0, 0.2), rng.uniform(1, 20)))
        routes.append(tuple(row))
    colls = []
    for _ in range(S):
        flows = ()
        if rng.random() < 0.3:
            bw, cap = wan[("a", "b")]
            flows = (WanFlow("a", "b", rng.uniform(1, 5), 0.3, bw, 1, cap),)
        colls.append(Collective(rng.uniform(0, 2), flows))
    return Job(t_f, t_b, tuple(routes), act_bytes=rng.uniform(0.5, 2.0), micro_batches=M,
               schedule=rng.choice(["1f1b", "1f1b", "gpipe"]), sharing=rng.choice(["temporal", "spatial"]),
               collectives=tuple(colls), blocking_sends=rng.random() < 0.7)


def test_the_bound_never_exceeds_the_simulator():
    rng = random.Random(12)
    for _ in range(300):
        job = _random_job(rng)
        assert lower_bound(job) <= simulate(job).iteration * (1 + 1e-9), job


@pytest.mark.parametrize("S, M", [(1, 1), (4, 6), (6, 3), (3, 12)])
def test_exact_without_communication(S, M):
    free = Route(0.0, float("inf"))
    job = Job(((1.0,),) * S, ((2.0,),) * S, ((free,),) * (S - 1), act_bytes=1.0, micro_batches=M)
    assert lower_bound(job) == pytest.approx(simulate(job).iteration) == pytest.approx((M + S - 1) * 3.0)


def test_tight_where_1f1b_stalls_on_a_wan_round_trip():
    """The issue's case: pp=12 tp=2 dp=1 on the two-DC example, where the old closed form said 11.02 s
    and the simulator 23.62 s (1F1B's in-flight limit waits out the WAN round trip every second
    micro-batch). The bound's window cycles see it."""
    t = topology.load("configs/atlas_two_dc.json")
    model = ModelSpec.from_dict(t.model)
    lay = Layout(2, tuple((("east",),) * 8 + (("west",),) * 4), (4,) * 12, connections=8, sharing="temporal")
    job = build(t, model, lay, window=2**21)
    lb, sim = lower_bound(job), simulate(job).iteration
    assert lb <= sim and lb >= 0.95 * sim, (lb, sim)
