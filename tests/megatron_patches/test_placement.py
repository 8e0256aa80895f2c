"""Topology-aware placement: the two slot orders, inter-node bytes, and the alpha-beta choice of C."""

import pytest

from megatron_patches.layout import Layout
from megatron_patches.placement import (
    Topology,
    choose,
    estimate,
    hop_messages,
    inter_node_bytes,
    nodes_of,
    ring_major,
    team_major,
)
from megatron_patches.volume import Shard, choose_backward

SHARD = Shard(s=4096, b=1, hq=32, hkv=32, d=128, elt=2, acc=4)
GQA = Shard(s=4096, b=1, hq=32, hkv=4, d=128, elt=2, acc=4)


def test_orders():
    assert team_major(16, 2) == tuple(range(16))
    for p, c in ((16, 2), (64, 2), (64, 4), (32, 4)):
        lay = Layout(p, c, ring_major(p, c))
        for r in range(p):
            ring = sorted(lay.ring_ranks(r))
            assert ring == list(range(ring[0], ring[0] + lay.ring_len)), "sub-rings on consecutive CP ranks"


def test_node_aware_keeps_sub_rings_inside_nodes():
    """TP = 2 on 8-GPU nodes: 4 CP ranks per node. Team groups (8 ranks) span two nodes, so with
    team-major sub-rings cross nodes; ring-major puts each sub-ring of G = 4 on one node and lets the
    teams cross instead. With MHA the K/V hops weigh more; with GQA 8:1 the team's queries do."""
    nodes = nodes_of(range(0, 32, 2), 8)
    team, ring = Layout(16, 2, team_major(16, 2)), Layout(16, 2, ring_major(16, 2))
    assert inter_node_bytes(ring, SHARD, nodes) < inter_node_bytes(team, SHARD, nodes)
    assert choose(16, SHARD, nodes, None, 2, "node-aware").order == ring.order
    assert inter_node_bytes(team, GQA, nodes) < inter_node_bytes(ring, GQA, nodes)
    assert choose(16, GQA, nodes, None, 2, "node-aware").order == team.order
    # A team group per node (8 CP ranks per node): only the placement crosses; team-major kept on a tie.
    nodes = nodes_of(range(16), 8)
    assert inter_node_bytes(team, SHARD, nodes) == inter_node_bytes(ring, SHARD, nodes)
    assert choose(16, SHARD, nodes, None, 2, "node-aware").order == team.order
    assert choose(16, SHARD, nodes, None, 2, "contiguous") == team


def test_auto_prefers_teams_across_slow_ethernet():
    """32 A100 in 2 nodes of 16 on 100 Gb/s Ethernet (paper Table 1), GPT-7B-like heads at 128K tokens:
    ring attention waits on the NIC every step; teams cut those bytes by C."""
    topo = Topology.from_specs(16, intra_gbytes=300, nic_gbytes=12.5, intra_us=3, nic_us=20, tflops=170)
    nodes = nodes_of(range(32), 16)
    sh = Shard(s=131072 // 32, b=1, hq=32, hkv=32, d=128, elt=2, acc=4)
    times = {c: estimate(Layout(32, c), sh, nodes, topo) for c in (1, 2, 4)}
    best = choose(32, sh, nodes, topo, "auto", "auto")
    assert best.team_size > 1 and times[1] > min(times.values())
    assert estimate(best, sh, nodes, topo) <= min(times.values())


def test_estimate_is_compute_bound_on_one_fast_node():
    """Eight GPUs on NVLink at 64K tokens: every C hides its hops behind compute, so a 10x faster link
    changes no estimate by more than 3% (what differs between the C is the kernel calls' sizes)."""
    def times(gbytes):
        topo = Topology.from_specs(8, intra_gbytes=gbytes, nic_gbytes=400, tflops=400, rank_nic_gbytes=50)
        sh = Shard(s=65536 // 8, b=1, hq=32, hkv=8, d=128, elt=2, acc=4)
        return [estimate(Layout(8, c), sh, [0] * 8, topo) for c in (1, 2)]
    assert times(4500) == pytest.approx(times(450), rel=0.03)


def test_choose_errors():
    with pytest.raises(ValueError, match="placement='random' is not one of"):
        choose(8, SHARD, [0] * 8, None, 2, "random")
    with pytest.raises(ValueError, match="need a Topology"):
        choose(8, SHARD, [0] * 8, None, "auto", "contiguous")
    with pytest.raises(ValueError, match="tflops=0"):
        Topology.from_specs(8, 1.0, 1.0, tflops=0)


def test_an_exchange_in_cpu_seconds_is_the_moving_ranks_share():
    """In CPU seconds (the ranks' mean work) a rank whose message goes to itself costs nothing, so the
    placement of C = 2 at P = 4 (Alg. 2 is a transpose there: ranks 0 and 3 keep their K/V) costs half an
    exchange; the ring (every rank moves) and the wall clock (the slowest message) cost a whole one."""
    from dataclasses import replace

    wall = Topology.from_specs(8, 100.0, 50.0)
    cpu = Topology.from_profile(replace(wall.profile, provenance={**wall.profile.provenance, "clock": "cpu"}))
    lay, nodes, n = Layout(4, 2), [0] * 4, 1 << 20
    place = [(r, lay.place_target(r)) for r in range(4)]
    assert [d for _, d in place] == [0, 2, 1, 3]
    one = wall.intra.alpha + wall.intra.beta * n
    assert wall.exchange(place, nodes, n) == pytest.approx(one)
    assert cpu.exchange(place, nodes, n) == pytest.approx(one / 2)
    ring = [(r, (r + 1) % 4) for r in range(4)]
    assert cpu.exchange(ring, nodes, n) == pytest.approx(one) == wall.exchange(ring, nodes, n)
    assert cpu.exchange([(r, r) for r in range(4)], nodes, n) == 0.0


def test_every_message_of_a_backward_hop_pays_its_alpha():
    """Ring attention on P = 4 ranks of one node, overlap 0 (so every message's time adds) and links far
    faster than the bytes need: the estimate grows with α by α per message the code sends (counted against
    the ledger in test_wallfacer.py) — 3 forward hops; 3 backward hops of 3 messages in "q" (MHA) plus the
    dQ's hop home, or of 2 in "kv" (GQA) plus the dK/dV home."""
    from dataclasses import replace

    def topo(alpha_us: float) -> Topology:
        spec = Topology.from_specs(8, 1e9, 1e9, intra_us=alpha_us)
        return Topology.from_profile(replace(spec.profile, overlap=0.0))
    lay, nodes = Layout(4, 1), [0] * 4
    for sh, mode, messages in ((SHARD, "q", 3 + 3 * 3 + 1), (GQA, "kv", 3 + 3 * 2 + 1)):
        assert choose_backward(lay, sh) == mode and hop_messages(mode) == {"q": 3, "kv": 2}[mode]
        grow = estimate(lay, sh, nodes, topo(50.0)) - estimate(lay, sh, nodes, topo(0.0))
        assert grow == pytest.approx(messages * 50e-6, rel=1e-6)
