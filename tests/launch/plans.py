"""Small plans for multi-rank tests, made through the real topology parser and planner."""

from launch.plan import topology
from launch.plan.estimate import ModelSpec
from launch.plan.placement import make_plan


def two_dc_plan(pp: int = 2, tp: int = 1, dp: int = 2, connections: int = 4, sharing: str = "temporal",
                layers: int = 4):
    """pp stages over data centers "a" (room for the first ceil(pp/2) stages) and "b", one host each;
    the planner picks the order of the two along the pipeline."""
    first = (pp + 1) // 2
    raw = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": first * tp * dp}], "ifname": "lo"},
                           "b": {"hosts": [{"name": "b0", "slots": (pp - first) * tp * dp}],
                                 "ifname": "lo"}},
           "wan": [{"between": ["a", "b"], "rtt_ms": 1, "bandwidth_gbps": 1, "window_mb": 4}]}
    model = ModelSpec(layers=layers, hidden=16, seq=8, global_batch=4 * dp, pp=pp, tp=tp, dp=dp)
    return make_plan(topology.parse(raw, source="test"), model, connections, sharing)


def three_dc_plan(dp: int = 3, connections: int = 1, sharing: str = "temporal"):
    """Three stages in data centers a, b, c (one host of dp slots each): stage 1 has WAN links on both
    sides, so it sends forward and backward over the WAN and takes turns on two token rings."""
    raw = {"datacenters": {n: {"hosts": [{"name": f"{n}0", "slots": dp}], "ifname": "lo"} for n in "abc"},
           "wan": [{"between": list(p), "rtt_ms": 1, "bandwidth_gbps": 1, "window_mb": 4}
                   for p in (("a", "b"), ("a", "c"), ("b", "c"))]}
    model = ModelSpec(layers=3, hidden=16, seq=8, global_batch=4 * dp, pp=3, tp=1, dp=dp)
    plan = make_plan(topology.parse(raw, source="test"), model, connections, sharing)
    assert plan.stage_dc == ("a", "b", "c"), plan.stage_dc
    return plan
