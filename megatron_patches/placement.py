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
included, by the alpha-beta time of :func:`estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from commweave import cost
from commweave.cost import AlphaBeta
from megatron_patches.layout import Layout, valid_team_sizes
from megatron_patches.volume import Shard, backward_bytes, choose_backward, forward_bytes

PLACEMENTS = ("contiguous", "node-aware", "auto")
BWD_FLOPS = 2.5  # FlashAttention-2's backward does 5 matmuls to the forward's 2


@dataclass(frozen=True)
class Calibration:
    """What the bare alpha-beta model leaves out, fitted so that it reproduces the paper's gains
    (wallfacer.md §11: DiT on 32 A100 with 100 Gb/s Ethernet, +114%; GPT on 64 H100 with 8x400 Gb/s
    InfiniBand, up to +77%; tests/megatron_patches/test_estimate.py holds the model to them).

    - ``nic_efficiency``: the share of a node's network line rate that NCCL's flows reach together
      (~0.8); ``flow_efficiency``: the share of its NIC's line rate *one* flow gets: ~0.8 with RDMA
      (InfiniBand, RoCE), ~0.25 over TCP sockets (plain Ethernet, NCCL's socket transport), where
      several concurrent flows are needed to fill the link. This is what lets WallFacer's placement
      (many flows at once) beat ring attention's one flow per node boundary on Ethernet.
    - ``link_efficiency``: the same for a rank's intra-node link (NVLink P2P reaches ~80%).
    - ``overlap``: the share of the shorter of (block compute, hop) that hides behind the longer
      one in a ring step; NCCL's kernels take SMs and memory bandwidth from the attention kernel.
    - ``attn_efficiency`` and ``half_rows``: the attention kernel reaches ``attn_efficiency`` of the
      dense peak on large blocks and half of that at ``half_rows`` query rows (launch and tail
      effects of FlashAttention-2 on short blocks).
    - ``step_overhead_s``: per ring step, what neither bytes nor FLOPs explain (launches, the host
      loop, stream waits).
    """

    nic_efficiency: float = 0.8
    flow_efficiency: float = 0.8
    link_efficiency: float = 0.8
    overlap: float = 0.8
    attn_efficiency: float = 0.45
    half_rows: int = 1024
    step_overhead_s: float = 40e-6

    def kernel_s(self, flops: float, rows: int, peak: float) -> float:
        """Seconds of an attention kernel doing ``flops`` with ``rows`` query rows per block."""
        return flops / (peak * self.attn_efficiency * rows / (rows + self.half_rows))

    def step_s(self, compute: float, hop: float) -> float:
        """One ring step: the hop in flight while the block is computed, overlapped imperfectly."""
        return max(compute, hop) + (1 - self.overlap) * min(compute, hop) + self.step_overhead_s


ETHERNET = Calibration(flow_efficiency=0.25)
NETWORKS = {"ib": Calibration(), "ethernet": ETHERNET}


@dataclass(frozen=True)
class Topology:
    """A two-level network: ``intra`` is one rank's link inside a node, ``nic`` a node's outside link
    (all its NICs), ``flow`` the most one rank's message gets between nodes (its own NIC); the links'
    bandwidths are the effective ones (line rate x the calibration's efficiencies)."""

    ranks_per_node: int
    intra: AlphaBeta
    nic: AlphaBeta
    flow: AlphaBeta
    flops: float  # dense bf16 FLOP/s of one rank (the peak; the calibration says how much attention gets)
    calib: Calibration = Calibration()

    @classmethod
    def from_specs(cls, ranks_per_node: int, intra_gbytes: float, nic_gbytes: float,
                   intra_us: float = 3.0, nic_us: float = 10.0, tflops: float = 300.0,
                   rank_nic_gbytes: float | None = None, calib: Calibration | None = None) -> Topology:
        """From line rates in GB/s (10⁹ bytes/s), µs and TFLOP/s; ``rank_nic_gbytes`` defaults to the
        node's."""
        if ranks_per_node < 1 or tflops <= 0:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and tflops={tflops} > 0")
        calib = calib or Calibration()
        nic = AlphaBeta.from_link(nic_us * 1e-6, nic_gbytes * calib.nic_efficiency * 1e9)
        one = nic_gbytes if rank_nic_gbytes is None else rank_nic_gbytes
        flow = AlphaBeta.from_link(nic_us * 1e-6, one * calib.flow_efficiency * 1e9)
        intra = AlphaBeta.from_link(intra_us * 1e-6, intra_gbytes * calib.link_efficiency * 1e9)
        return cls(ranks_per_node, intra, nic, flow, tflops * 1e12, calib)

    def exchange(self, pairs, nodes, n: float) -> float:
        return cost.exchange(self.intra, self.nic, pairs, nodes, n, self.flow)


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


def _team_link(lay: Layout, nodes: list[int], topo: Topology) -> AlphaBeta:
    """Team collectives run on NVLink when every team is inside a node, else on a NIC share."""
    if all(len({nodes[m] for m in lay.team_ranks(t)}) == 1 for t in range(lay.teams)):
        return topo.intra
    per_node = max(nodes.count(n) for n in set(nodes))
    return AlphaBeta(topo.nic.alpha, max(topo.nic.beta * per_node, topo.flow.beta))


def estimate(lay: Layout, sh: Shard, nodes: list[int], topo: Topology, causal: bool = True) -> float:
    """Seconds for one attention forward + backward: collectives, placement, and G overlapped steps.

    A ring step computes one team block while the next hop is in flight (Calibration.step_s); C·s
    query rows meet C·s keys per block, so the compute per step is 4·b·h·(C·s)²·d FLOPs (half of it
    when causal) at the kernel's efficiency for C·s rows, ×2.5 in the backward.
    """
    c, g, world = lay.team_size, lay.ring_len, lay.world
    e, acc = sh.elt, sh.acc
    link = _team_link(lay, nodes, topo)
    flops = 4 * sh.b * sh.hq * (c * sh.s) ** 2 * sh.d * (0.5 if causal else 1.0)
    step = topo.calib.kernel_s(flops, c * sh.s, topo.flops)
    ring = [(r, lay.ring_next(r)) for r in range(world)]
    place = [(r, lay.place_target(r)) for r in range(world)]

    def hop(n: float) -> float:
        return topo.exchange(ring, nodes, n) if g > 1 else 0.0

    def steps(t_compute: float, t_hop: float) -> float:
        return (g - 1) * topo.calib.step_s(t_compute, t_hop) + t_compute + topo.calib.step_overhead_s

    def team(n_in: float) -> float:
        return cost.all_gather(link, c * n_in, c)

    mode = choose_backward(lay, sh)
    fwd = (team((sh.a_q + 2 * sh.a_kv) * e) + team(c * sh.rows * acc)
           + topo.exchange(place, nodes, 2 * c * sh.a_kv * e)
           + steps(step, hop(2 * c * sh.a_kv * e))
           + cost.reduce_scatter(link, c * sh.a_q * e, c))
    if mode == "kv":
        back = [(r, lay.place_source(lay.ring_next(r))) for r in range(world)]
        ring_bwd = steps(BWD_FLOPS * step, hop(2 * c * sh.a_kv * (e + acc)))
        home = topo.exchange(back, nodes, 2 * c * sh.a_kv * acc)
    else:  # q, dO, lse and D = rowsum(dO∘O) travel (volume.py), then dQ
        back = [(r, lay.place_source(r)) for r in range(world)]
        ring_bwd = steps(BWD_FLOPS * step, hop(c * (2 * sh.a_q * e + 2 * sh.rows * acc + sh.a_q * acc)))
        home = (hop(c * sh.a_q * acc)
                + topo.exchange(back, nodes, 2 * c * sh.a_kv * acc))
    # dO and D gathered in the team; with C > 1 the team Q/K/V are rebuilt there (team_qkv="auto").
    rebuild = (team((sh.a_q + 2 * sh.a_kv) * e) + topo.exchange(place, nodes, 2 * c * sh.a_kv * e)
               if c > 1 else 0.0)
    bwd = (team(sh.a_q * e + sh.rows * acc) + rebuild + ring_bwd + home
           + cost.reduce_scatter(link, c * (sh.a_q + 2 * sh.a_kv) * e, c))
    return fwd + bwd


def choose(world: int, sh: Shard, nodes: list[int], topo: Topology | None, team_size: int | str,
           placement: str, layout: str = "zigzag", causal: bool = True) -> Layout:
    """The Layout for a placement rule and a team size (an int, or "auto" to let the cost model pick).

    ``topo`` is needed for "auto" (team size or placement); ``nodes`` gives each CP rank's node.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    if (team_size == "auto" or placement == "auto") and topo is None:
        raise ValueError("team_size='auto' and placement='auto' need a Topology for the cost model")
    sizes = valid_team_sizes(world) if team_size == "auto" else [int(team_size)]
    candidates = []
    for c in sizes:
        orders = ["team-major"] if placement == "contiguous" else list(ORDERS)
        lays = [Layout(world, c, ORDERS[o](world, c), layout) for o in orders]
        if placement == "node-aware":
            lays = [min(lays, key=lambda lay: inter_node_bytes(lay, sh, nodes))]
        candidates += lays
    if len(candidates) == 1:
        return candidates[0]
    return min(candidates, key=lambda lay: estimate(lay, sh, nodes, topo, causal))
