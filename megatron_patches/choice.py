"""Which (U, C, slot order) a CP group runs: every plan auto chooses among, priced by the cost model.

A plan is a Ulysses size U (an all-to-all over heads inside groups of U ranks of one node), a WallFacer
team size C over the P/U groups (C = 1: ring attention) and the slot order of that WallFacer
(placement.ORDERS). Each group rank holds U·N/P tokens of h/U heads; K/V heads fewer than U are
replicated to U/g ranks, as hybrid.py sends them. The seconds are placement.estimate's for the WallFacer
part (the profile's kernels, links and collectives) plus the head all-to-alls plus the profile's host work
of the plan (host.py) and its memory traffic (memory.py; each 0 where the profile has none).
:func:`choose_hybrid` is auto's choice (attention.plan_layout calls it for one CP group's shards),
:func:`reason` what it prints;
``python -m megatron_patches.estimate`` tabulates the same plans for a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from commweave.cost import AlphaBeta
from megatron_patches.hybrid import ulysses_error
from megatron_patches.layout import Layout, team_size_error, valid_team_sizes
from megatron_patches.placement import ORDERS, Topology, choose, estimate, step_shapes
from megatron_patches.volume import Shard


@dataclass(frozen=True)
class Plan:
    """One way to run a CP group's attention: Ulysses size U, team size C, the slot order of WallFacer
    over the P/U groups (``layout``: what WallFacerAttention hands wallfacer_attention), and the
    model's seconds (None where nothing was left to the model)."""

    ulysses_size: int
    team_size: int
    order: str
    seconds: float | None
    layout: Layout | None = None


def _wire_kv_heads(sh: Shard, u: int) -> int:
    """K/V heads one rank's all-to-all carries: g when U divides g, else U (each of the g heads is
    replicated to the U/g members whose query heads read it, hybrid.py)."""
    return u * max(1, sh.hkv // u)


def _all_to_all(sh: Shard, u: int, nodes: list[int], topo: Topology) -> float:
    """The head all-to-alls of one forward + backward over groups of u consecutive ranks: q, k, v in
    and O out; dO in and dq, dk, dv out (each rank keeps 1/u of its buffer, sends the rest). With
    fewer K/V heads than u the replicated heads ride along (volume.hybrid_bytes)."""
    if u == 1:
        return 0.0
    n = 4 * (sh.a_q + sh.s * sh.b * _wire_kv_heads(sh, u) * sh.d) * sh.elt
    group_nodes = nodes[:u]
    per_node = group_nodes.count(group_nodes[0])
    if per_node == u:  # four all-to-all calls (q/k/v, O, dO, dq/dk/dv): the profile's α_U and efficiency
        return 3 * topo.profile.collective("all_to_all", u).alpha_s + topo.collective("all_to_all", u, n)
    if topo.nic is None:
        raise ValueError("the profile has no inter-node link: calibrate on two or more nodes")
    # Across nodes: the node's NICs carry every local rank's share that leaves the node.
    inter = n * (u - per_node) / u * per_node * topo.nic.beta
    intra = n * (per_node - 1) / u * topo.intra.beta
    return 4 * (u - 1) * topo.nic.alpha + max(inter, intra)


def _hybrid_parts(sh: Shard, u: int, nodes: list[int], topo: Topology | None):
    """The WallFacer problem each of the u parallel groups solves, with the network it shares. The
    nodes are outer group 0's (CP ranks 0, U, 2U ...): with Ulysses groups inside nodes every outer
    group sees the same ones, and every rank plans alike."""
    inner = Shard(sh.s * u, sh.b, sh.hq // u, max(sh.hkv // u, 1), sh.d, sh.elt, sh.acc)
    sub_nodes = nodes[::u]
    shared = topo if topo is None or topo.nic is None else \
        replace(topo, nic=AlphaBeta(topo.nic.alpha, topo.nic.beta * u))
    return inner, sub_nodes, shared


def plan_s(world: int, sh: Shard, nodes: list[int], topo: Topology, u: int, c: int, order: str,
           causal: bool = True, layout: str = "zigzag") -> float:
    """Seconds of one given (U, C, slot order): WallFacer over the P/U groups, the head all-to-alls and
    the plan's own code (code_s: host work and memory traffic)."""
    inner, sub_nodes, shared = _hybrid_parts(sh, u, nodes, topo)
    p = world // u
    lay = Layout(p, c, ORDERS[order](p, c), layout)
    return (estimate(lay, inner, sub_nodes, shared, causal) + _all_to_all(sh, u, nodes, topo)
            + code_s(world, sh, topo, u, c, order))


def code_s(world: int, sh: Shard, topo: Topology, u: int, c: int, order: str) -> float:
    """The profile's seconds of the plan's own code besides kernels and messages: its host work (host.py)
    and its memory traffic at this shard's size (memory.py); 0 for what the profile does not hold."""
    return (topo.profile.host_s(world, u, c, order)
            + topo.profile.memory_s(world, u, c, order, sh.s, sh.b * sh.hq * sh.d * sh.elt))


def candidates(world: int, sh: Shard, nodes: list[int]) -> list[tuple[int, int, str]]:
    """Every (U, C, order) auto chooses among, each order once where it is a different layout."""
    out = []
    for u in [1, *hybrid_sizes(world, sh, nodes)]:
        p = world // u
        for c in valid_team_sizes(p):
            seen = set()
            for name, order in ORDERS.items():
                if order(p, c) not in seen:
                    seen.add(order(p, c))
                    out.append((u, c, name))
    return out


def call_shapes(world: int, sh: Shard, nodes: list[int], causal: bool = True,
                layout: str = "zigzag") -> list[tuple[str, int, int, int]]:
    """Every distinct block call the candidates make (placement.step_shapes of each one's WallFacer over
    the P/U groups, forward and backward), as (curve, rows, keys, b·h heads): what calibrate measures
    exactly for this problem (Profile.calls), so that no plan's calls are priced off the square blocks."""
    out = set()
    for u, c, order in candidates(world, sh, nodes):
        inner, p = _hybrid_parts(sh, u, nodes, None)[0], world // u
        lay = Layout(p, c, ORDERS[order](p, c), layout)
        for step in step_shapes(lay, inner.s, causal):
            for calls, _ in step:
                for rows, keys, diag in calls:
                    for back in ("fwd", "bwd"):
                        out.add((back + ("_causal" if diag else ""), rows, keys, inner.b * inner.hq))
    return sorted(out)


def plan(world: int, sh: Shard, nodes: list[int], topo: Topology | None, u: int,
         team_size: int | str = "auto", placement: str = "auto", causal: bool = True,
         layout: str = "zigzag") -> Plan:
    """(U, C) for one CP group of ``world`` ranks with this rank's shard ``sh``: placement.choose over
    the P/U groups (C and the order by the model where "auto"), timed when ``topo`` is given.

    ValueError for what the hybrid refuses (hybrid.ulysses_error: U must divide P and the query
    heads, the K/V heads must be a multiple of U or divide it) and for C² not dividing P/U.
    """
    error = ulysses_error(world, u, sh.hq, sh.hkv)
    if error is None and team_size != "auto":
        error = team_size_error(world // u, team_size)
    if error:
        raise ValueError(error)
    inner, sub_nodes, shared = _hybrid_parts(sh, u, nodes, topo)
    p = world // u
    host = None if topo is None else (lambda c, order: code_s(world, sh, topo, u, c, order))
    lay = choose(p, inner, sub_nodes, shared, team_size, placement, layout, causal, host)
    name = next(n for n, order in ORDERS.items() if tuple(order(p, lay.team_size)) == lay.order)
    seconds = None if topo is None else (estimate(lay, inner, sub_nodes, shared, causal)
                                         + _all_to_all(sh, u, nodes, topo)
                                         + code_s(world, sh, topo, u, lay.team_size, name))
    return Plan(u, lay.team_size, name, seconds, lay)


def hybrid_s(world: int, sh: Shard, nodes: list[int], topo: Topology, u: int, c: int,
             causal: bool = True) -> tuple[float, str]:
    """Seconds of (U, C) and the better slot order of its WallFacer part."""
    best = plan(world, sh, nodes, topo, u, c, "auto", causal)
    return best.seconds, best.order


def ulysses_s(world: int, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> float | None:
    """DeepSpeed-Ulysses over all P ranks (K/V heads repeated up to P when fewer), or None when the
    query heads do not split over P."""
    if sh.hq % world or (sh.hkv % world and world % sh.hkv):
        return None
    kv = Shard(sh.s, sh.b, sh.hq, max(sh.hkv, world), sh.d, sh.elt, sh.acc)
    n_rows = sh.s * world
    attn = sum(topo.call_s(n_rows, n_rows, causal, sh.b * (sh.hq // world), sh.d, backward)
               for backward in (False, True))
    return attn + _all_to_all(kv, world, nodes, topo)


def hybrid_sizes(world: int, sh: Shard, nodes: list[int]) -> list[int]:
    """U > 1 for the hybrid: what hybrid.py runs (U | P, U | query heads, K/V heads a multiple of U or
    dividing it) with every Ulysses group of U consecutive CP ranks inside one node."""
    return [u for u in range(2, world + 1)
            if ulysses_error(world, u, sh.hq, sh.hkv) is None
            and all(len(set(nodes[i:i + u])) == 1 for i in range(0, world, u))]


def plans(world: int, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> list[Plan]:
    """Every (U, C), U = 1 first (WallFacer alone; C = 1 is ring attention), each with its better order."""
    return [plan(world, sh, nodes, topo, u, c, "auto", causal)
            for u in [1, *hybrid_sizes(world, sh, nodes)] for c in valid_team_sizes(world // u)]


def ranked(world: int, sh: Shard, nodes: list[int], topo: Topology | None, causal: bool = True, *,
           ulysses_size: int | str = "auto", team_size: int | str = "auto", placement: str = "auto",
           layout: str = "zigzag") -> list[Plan]:
    """Every plan choose_hybrid considers, fastest first (ties: the smaller U, then the smaller C)."""
    if ulysses_size != "auto":
        return [plan(world, sh, nodes, topo, ulysses_size, team_size, placement, causal, layout)]
    if topo is None:
        raise ValueError("ulysses_size='auto' needs a Topology for the cost model")
    candidates = []
    for u in [1, *hybrid_sizes(world, sh, nodes)]:
        sizes = valid_team_sizes(world // u) if team_size == "auto" else [team_size]
        candidates += [plan(world, sh, nodes, topo, u, c, placement, causal, layout)
                       for c in sizes if team_size_error(world // u, c) is None]
    if not candidates:
        raise ValueError(team_size_error(world, team_size))
    return sorted(candidates, key=lambda p: (p.seconds, p.ulysses_size, p.team_size))


def choose_hybrid(world: int, sh: Shard, nodes: list[int], topo: Topology | None, causal: bool = True, *,
                  ulysses_size: int | str = "auto", team_size: int | str = "auto",
                  placement: str = "auto", layout: str = "zigzag") -> Plan:
    """WallFacerAttention's choice for one CP group (``nodes``: each CP rank's node; ``sh``: one rank's
    shard as Megatron hands it): the fastest plan among the U allowed ("auto": 1 and hybrid_sizes) and
    the team sizes allowed ("auto": every valid C, else the given C where it is valid for P/U), each
    with ``placement``'s order. A pure function of its arguments: every rank makes the same choice.
    ``topo`` may be None when nothing is "auto". Ties go to the smaller U, then the smaller C.
    """
    return ranked(world, sh, nodes, topo, causal, ulysses_size=ulysses_size, team_size=team_size,
                  placement=placement, layout=layout)[0]


def reason(plans: list[Plan], topo: Topology, top: int = 3) -> str:
    """Why auto chose its plan: the profile it priced with and the ``top`` fastest candidates."""
    prof = topo.profile
    src = (f"measured profile: {prof.description}" if prof.source == "measured" else
           f"no measured profile, so the stated default, the spec model of the cluster flags: "
           f"{prof.description}; "
           f"--wallfacer-profile or $COMMWEAVE_WALLFACER_PROFILE names one that "
           f"python -m megatron_patches.estimate --calibrate writes")
    rows = "; ".join(f"U={p.ulysses_size} C={p.team_size} {p.order} {1e3 * p.seconds:.3g} ms"
                     for p in plans[:top])
    return (f"WallFacer auto picks U={plans[0].ulysses_size}, C={plans[0].team_size}, {plans[0].order} "
            f"({src}); fastest predicted: {rows}")
