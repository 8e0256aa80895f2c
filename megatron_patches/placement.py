"""Topology-aware placement (wallfacer.md §9): which ranks form teams and sub-rings, and which C.

Inter-node links are the slow ones, and ring attention puts one on the critical path of each of its
P−1 steps. WallFacer can keep either its team collectives or its sub-rings inside a node. Two slot
orders (layout.py: ``order[slot]`` = CP group rank) express the choice:

- ``team_major``: slot g = r_t·C + r_a on consecutive CP ranks (the paper's numbering): teams, then
  team groups, are as compact as possible; with G·C = P/C ≤ ranks per node every sub-ring is
  intra-node too and only the placement crosses nodes.
- ``ring_major``: the G members of a sub-ring sit on consecutive CP ranks (team group γ, intra
  rank r_a, team t: rank γ·P/C + r_a·G + t mod G): sub-rings stay inside a node even when a team
  group does not fit in one; teams then span G ranks.

Placements: ``contiguous`` is team_major; ``node-aware`` takes the order that moves fewer bytes
between nodes (volume.py's bytes, node map only); ``auto`` also chooses C, C = 1 (ring attention)
included, by the time :func:`estimate` predicts from a cost profile (profile.py: measured by
``python -m megatron_patches.estimate --calibrate``, or built from public specs, specs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from commweave import cost
from commweave.cost import AlphaBeta
from megatron_patches import packing
from megatron_patches.layout import Layout, valid_team_sizes
from megatron_patches.profile import BWD_FLOPS, FWD_FLOPS, Profile
from megatron_patches.rowmap import block_calls, team_rows
from megatron_patches.volume import Shard, backward_bytes, choose_backward, forward_bytes

PLACEMENTS = ("contiguous", "node-aware", "auto")


@dataclass(frozen=True)
class Topology:
    """A two-level network and its ranks' kernels, as the cost model sees them (from a Profile):
    ``intra`` one rank's link inside a node, ``nic`` a node's outside link (all its NICs), ``flow`` the
    most one rank's message gets between nodes (its own NIC); ``nic`` and ``flow`` are None for a profile
    of one node, which then prices nothing that crosses nodes (ValueError)."""

    ranks_per_node: int
    intra: AlphaBeta
    nic: AlphaBeta | None
    flow: AlphaBeta | None
    profile: Profile

    @classmethod
    def from_profile(cls, profile: Profile, ranks_per_node: int | None = None) -> Topology:
        inter = profile.inter
        nic = None if inter is None else AlphaBeta(inter.alpha_s, 1 / (profile.node_gbytes * 1e9))
        flow = None if inter is None else AlphaBeta(inter.alpha_s, inter.beta)
        intra = AlphaBeta(profile.intra.alpha_s, profile.intra.beta)
        return cls(ranks_per_node or profile.ranks_per_node, intra, nic, flow, profile)

    @classmethod
    def from_specs(cls, ranks_per_node: int, intra_gbytes: float, nic_gbytes: float,
                   intra_us: float = 3.0, nic_us: float = 10.0, tflops: float = 300.0,
                   rank_nic_gbytes: float | None = None, network: str = "ib",
                   kernel: str = "fa2-a100") -> Topology:
        """The spec model (specs.spec_profile) from line rates in GB/s, µs and peak TFLOP/s."""
        from megatron_patches.specs import spec_profile

        return cls.from_profile(spec_profile(ranks_per_node, intra_gbytes, nic_gbytes, rank_nic_gbytes,
                                             intra_us, nic_us, tflops, network, kernel))

    def exchange(self, pairs, nodes, n: float) -> float:
        """One message of n bytes from each rank s to d for (s, d) in ``pairs`` (one pair per rank): the
        slowest message (cost.exchange), or, for a profile in CPU seconds, the ranks' mean (calibrate
        --clock cpu measures each rank's own work, averaged over the ranks, as compute_steps prices the
        kernels): a rank whose message goes to itself moves nothing (wallfacer.py sends nothing then), so
        a permutation with fixed points costs the moving ranks' share, m/P, of one exchange — exact on one
        node, where every message costs the same; an upper bound across nodes."""
        crosses = any(nodes[s] != nodes[d] for s, d in pairs)
        if crosses and self.nic is None:
            raise ValueError(f"the profile ({self.profile.description or self.profile.source}) has no "
                             f"inter-node link: calibrate on two or more nodes to plan across nodes")
        slowest = cost.exchange(self.intra, self.nic or self.intra, pairs, nodes, n, self.flow)
        if self.profile.provenance.get("clock") != "cpu" or not pairs:
            return slowest
        return slowest * sum(s != d for s, d in pairs) / len(pairs)

    def collective(self, kind: str, g: int, n: float, link: AlphaBeta | None = None) -> float:
        """``kind`` on g ranks, n = cost.py's bytes (all_gather: the gathered buffer; reduce_scatter and
        all_to_all: one rank's input): the profile's α_g and efficiency on the intra link, or on
        ``link`` (a NIC share) for a group across nodes, α per ring step there."""
        if g <= 1:
            return 0.0
        c = self.profile.collective(kind, g)
        if link is None:
            return c.alpha_s + self.intra.beta * n * (g - 1) / g / c.efficiency
        return (g - 1) * link.alpha + link.beta * n * (g - 1) / g / c.efficiency

    def step_s(self, compute: float, hop: float) -> float:
        """One ring step: the hop in flight while the block is computed; ``overlap`` (measured, or 1 from
        the specs: a separate stream) is the share of the shorter hidden behind the longer. A CPU-clock
        profile's may be below 0 (calibrate.py): the hop run beside the block costs that share of the
        shorter more than the two apart."""
        return max(compute, hop) + (1 - self.profile.overlap) * min(compute, hop)

    def call_s(self, rows: int, keys: int, diag: bool, heads: int, d: int, backward: bool) -> float:
        """One kernel call over ``heads`` = b·h heads of dim d: its measured seconds where the profile
        holds this exact call (Profile.calls), else FWD/BWD_FLOPS x its score entries x b·h·d at the
        profile's throughput for a call of that work (score entries x b·h)."""
        scores = rows * (rows + 1) / 2 if diag else rows * keys
        name = ("bwd" if backward else "fwd") + ("_causal" if diag else "")
        exact = self.profile.call_seconds(name, rows, keys, heads, d)
        if exact is not None:
            return exact
        per = BWD_FLOPS if backward else FWD_FLOPS
        return per * scores * heads * d / (self.profile.attention[name].tflops(heads, scores * heads) * 1e12)


@lru_cache(maxsize=256)
def step_shapes(lay: Layout, s: int, causal: bool) -> tuple[tuple[tuple[tuple, int], ...], ...]:
    """Per ring step, the distinct per-rank lists of kernel calls (rows, keys, diagonal) that the step's
    ranks make (rowmap.block_calls on the dense layout: what wallfacer.py runs), each with how many ranks
    make it."""
    shards = packing.shards(packing.dense(lay.world * s), lay.layout, lay.world)
    rows = [team_rows(tuple(shards[r] for r in lay.team_ranks(t))) for t in range(lay.teams)]
    out = []
    for i in range(lay.ring_len):
        kinds: dict[tuple, int] = {}
        for r in range(lay.world):
            qt, kt = lay.team_of(r), lay.kv_team(r, i)
            calls = tuple(sorted((q1 - q0, k1 - k0, d) for q0, q1, k0, k1, d in
                                 block_calls(rows[qt], rows[kt], causal, qt == kt)))
            kinds[calls] = kinds.get(calls, 0) + 1
        out.append(tuple(sorted(kinds.items())))
    return tuple(out)


def compute_steps(lay: Layout, sh: Shard, topo: Topology, causal: bool, backward: bool) -> list[float]:
    """Seconds of each ring step's block: on its slowest rank (wall time: the ring waits for it), or the
    mean over ranks for a profile in CPU seconds (calibrate --clock cpu: what it measures is each rank's
    own work, averaged over the ranks, so a rank's lighter step is not priced as the heaviest)."""
    mean = topo.profile.provenance.get("clock") == "cpu"
    out = []
    for step in step_shapes(lay, sh.s, causal):
        per = [(sum(topo.call_s(r, k, diag, sh.b * sh.hq, sh.d, backward) for r, k, diag in calls), n)
               for calls, n in step]
        out.append(sum(t * n for t, n in per) / lay.world if mean else max(t for t, _ in per))
    return out


def team_major(world: int, team_size: int) -> tuple[int, ...]:
    return tuple(range(world))


def ring_major(world: int, team_size: int) -> tuple[int, ...]:
    c, g = team_size, world // (team_size * team_size)
    order = []
    for slot in range(world):
        r_t, r_a = divmod(slot, c)
        order.append((r_t // g) * c * g + r_a * g + r_t % g)
    return tuple(order)


ORDERS = {"team-major": team_major, "ring-major": ring_major}


def nodes_of(global_ranks, ranks_per_node: int) -> list[int]:
    """Node of each CP rank, for nodes of ``ranks_per_node`` consecutive global ranks."""
    return [g // ranks_per_node for g in global_ranks]


def inter_node_bytes(lay: Layout, sh: Shard, nodes: list[int]) -> int:
    """Bytes crossing node boundaries in one forward + backward ("kv" backward), summed over ranks."""
    total = 0
    for r in range(lay.world):
        moves = {"ring": lay.ring_next(r), "cp": lay.place_target(r)}
        team_nodes = {nodes[m] for m in lay.team_ranks(lay.team_of(r))}
        for counts in (forward_bytes(lay, sh, r, checked=False), backward_bytes(lay, sh, r, "kv")):
            for (_, group), n in counts.items():
                crosses = (len(team_nodes) > 1 if group == "team"
                           else nodes[r] != nodes[moves[group]])
                total += n if crosses else 0
    return total


def _team_link(lay: Layout, nodes: list[int], topo: Topology) -> AlphaBeta | None:
    """None (the profile's intra-node collectives) when every team is inside a node, else a NIC share:
    the node's NIC divided among its ranks, no faster than one rank's own NIC."""
    if all(len({nodes[m] for m in lay.team_ranks(t)}) == 1 for t in range(lay.teams)):
        return None
    if topo.nic is None:
        raise ValueError(f"the profile ({topo.profile.description or topo.profile.source}) has no "
                         f"inter-node link: calibrate on two or more nodes to plan teams across nodes")
    per_node = max(nodes.count(n) for n in set(nodes))
    return AlphaBeta(topo.nic.alpha, max(topo.nic.beta * per_node, topo.flow.beta))


def hop_messages(mode: str) -> int:
    """Messages per backward sub-ring hop, each its own send and receive (backward.py): "kv" sends the K/V
    and the dK/dV relay, "q" the stacked (q, dO), the stacked (lse, D) and the dQ relay. A forward hop is
    one message (the K/V stack). The bytes are volume.py's either way; each message pays its α."""
    return 2 if mode == "kv" else 3


def estimate(lay: Layout, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> float:
    """Seconds for one attention forward + backward: collectives, placement, and G overlapped steps.

    Each ring step computes the kernel calls wallfacer.py makes for its team block (step_shapes), on the
    slowest rank, while the next hop is in flight (Topology.step_s); the bytes of every message are
    volume.py's (the ledger's), priced with the profile's links and collectives.
    """
    c, g, world = lay.team_size, lay.ring_len, lay.world
    e, acc = sh.elt, sh.acc
    link = _team_link(lay, nodes, topo)
    fwd_c = compute_steps(lay, sh, topo, causal, backward=False)
    bwd_c = compute_steps(lay, sh, topo, causal, backward=True)
    ring = [(r, lay.ring_next(r)) for r in range(world)]
    place = [(r, lay.place_target(r)) for r in range(world)]

    def hop(n: float, messages: int = 1) -> float:
        """One sub-ring hop of n bytes in ``messages`` messages (each its own send and receive: α each)."""
        if g == 1:
            return 0.0
        return topo.exchange(ring, nodes, n) + (messages - 1) * topo.exchange(ring, nodes, 0.0)

    def steps(blocks: list[float], t_hop: float) -> float:
        return sum(topo.step_s(t, t_hop) for t in blocks[:-1]) + blocks[-1]

    def team(n_in: float) -> float:
        return topo.collective("all_gather", c, c * n_in, link)

    def scatter(n_in: float) -> float:
        return topo.collective("reduce_scatter", c, n_in, link)

    mode = choose_backward(lay, sh)
    fwd = (team((sh.a_q + 2 * sh.a_kv) * e) + team(c * sh.rows * acc)
           + topo.exchange(place, nodes, 2 * c * sh.a_kv * e)
           + steps(fwd_c, hop(2 * c * sh.a_kv * e))
           + scatter(c * sh.a_q * e))
    if mode == "kv":
        back = [(r, lay.place_source(lay.ring_next(r))) for r in range(world)]
        ring_bwd = steps(bwd_c, hop(2 * c * sh.a_kv * (e + acc), hop_messages(mode)))
        home = topo.exchange(back, nodes, 2 * c * sh.a_kv * acc)
    else:  # q, dO, lse and D = rowsum(dO∘O) travel (volume.py), then dQ
        back = [(r, lay.place_source(r)) for r in range(world)]
        ring_bwd = steps(bwd_c, hop(c * (2 * sh.a_q * e + 2 * sh.rows * acc + sh.a_q * acc),
                                    hop_messages(mode)))
        home = (hop(c * sh.a_q * acc)
                + topo.exchange(back, nodes, 2 * c * sh.a_kv * acc))
    # dO and D gathered in the team; with C > 1 the team Q/K/V are rebuilt there (team_qkv="auto").
    rebuild = (team((sh.a_q + 2 * sh.a_kv) * e) + topo.exchange(place, nodes, 2 * c * sh.a_kv * e)
               if c > 1 else 0.0)
    bwd = (team(sh.a_q * e + sh.rows * acc) + rebuild + ring_bwd + home
           + scatter(c * (sh.a_q + 2 * sh.a_kv) * e))
    return fwd + bwd


def choose(world: int, sh: Shard, nodes: list[int], topo: Topology | None, team_size: int | str,
           placement: str, layout: str = "zigzag", causal: bool = True, host=None) -> Layout:
    """The Layout for a placement rule and a team size (an int, or "auto" to let the cost model pick).

    ``topo`` is needed for "auto" (team size or placement); ``nodes`` gives each CP rank's node.
    ``host(c, order name)``: seconds the cost model adds to a layout's estimate besides its kernels and
    bytes (choice.plan: the profile's host work of the plan, host.py), so that "auto" weighs the two slot
    orders of one C, and the team sizes, by the same seconds the plan is priced at; None adds nothing.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    if (team_size == "auto" or placement == "auto") and topo is None:
        raise ValueError("team_size='auto' and placement='auto' need a Topology for the cost model")
    sizes = valid_team_sizes(world) if team_size == "auto" else [int(team_size)]
    candidates = []
    for c in sizes:
        orders = ["team-major"] if placement == "contiguous" else list(ORDERS)
        # An order giving the same slots as an earlier one is that layout again (and host work is
        # measured under the first name only: choice.candidates).
        lays = [(Layout(world, c, ORDERS[o](world, c), layout), o) for i, o in enumerate(orders)
                if ORDERS[o](world, c) not in [ORDERS[e](world, c) for e in orders[:i]]]
        if placement == "node-aware":
            lays = [min(lays, key=lambda lo: inter_node_bytes(lo[0], sh, nodes))]
        candidates += lays
    if len(candidates) == 1:
        return candidates[0][0]
    extra = host or (lambda c, order: 0.0)
    return min(candidates, key=lambda lo: estimate(lo[0], sh, nodes, topo, causal)
               + extra(lo[0].team_size, lo[1]))[0]
