"""The planner's cost model: per-layer formulas, a layout's job for the simulator, layer splits."""

from dataclasses import replace

import pytest

from commweave import cost
from launch.plan import topology
from launch.plan.estimate import (
    Layout,
    ModelSpec,
    build,
    fits,
    layer_caps,
    memory,
    nccl_memory,
    split_layers,
    stage_layers,
)
from launch.plan.socket_limits import nccl_buffer_memory, nccl_communicators

RAW = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": 4}], "gpu_tflops": 100, "gpu_memory_gb": 80,
                             "node_bandwidth_gbps": 800, "intra_bandwidth_gbps": 80},
                       "b": {"hosts": [{"name": "b0", "slots": 4}], "gpu_tflops": 300}},
       "wan": [{"between": ["a", "b"], "rtt_ms": 20, "bandwidth_gbps": 8, "window_mb": 1}]}
M = ModelSpec(layers=6, hidden=1024, seq=512, global_batch=16, micro_batch=2)


def test_model_formulas():
    assert M.layer_params == 12 * 1024**2
    assert M.layer_flops == 24 * 2 * 512 * 1024**2 + 4 * 2 * 512**2 * 1024
    assert M.act_bytes == 2 * 512 * 1024 * 2
    assert M.micro_batches(dp=2) == 4 and M.sequences == 8
    assert stage_layers(7, 3) == [3, 2, 2]
    assert M.stage_memory(2, 3, 1) == 2 * M.layer_params * 16 + 3 * 2 * 34 * 512 * 2 * 1024


def test_atlas_layout_job():
    t = topology.parse(RAW)
    lay = Layout(1, (("a", "a"), ("a", "a"), ("b", "b")), (2, 2, 2), connections=4, sharing="temporal")
    job = build(t, M, lay, window=2**21)
    fast, slow = 2 * M.layer_flops / 300e12, 2 * M.layer_flops / 100e12     # 2 layers, tp=1
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(job.t_f) == pytest.approx([slow] * 4 + [fast] * 2)       # no TP: no TP all-reduce
    assert flat(job.t_b) == pytest.approx([2 * slow] * 4 + [2 * fast] * 2)
    intra, wan = job.routes
    assert intra[0].wan is None and intra[0].bandwidth == 80e9 / 8
    # the WAN: 8 Gb/s, one transfer striped over tp x 4 connections of window_mb / RTT (not the default)
    assert wan[1].wan == ("a", "b") and wan[1].bandwidth == 1e9 and wan[1].streams == 4
    assert wan[1].stream_cap == pytest.approx(2**20 / 0.020) and wan[1].latency == pytest.approx(0.010)
    assert job.micro_batches == 4 and job.sharing == "temporal" and job.blocking_sends
    # each stage's DP all-reduce stays in its DC: a ring of 2 on the host's NVLink-class link
    grads = 2 * M.layer_params * 2
    node = cost.AlphaBeta.from_link(10e-6, 800e9 / 8)
    assert job.collectives[0].seconds == pytest.approx(cost.all_reduce(node, grads, 2))
    assert not any(c.flows for c in job.collectives)


def test_a_dp_group_across_the_wan_puts_its_ring_hops_on_the_links():
    t = topology.parse(RAW)
    lay = Layout(2, (("a", "a", "b"),), (6,))             # one stage, replicas in a, a, b: ring a a b
    c = build(t, M, lay, window=2**21).collectives[0]
    grads = 6 * M.layer_params / 2 * 2
    assert [(f.src, f.dst) for f in c.flows] == [("a", "b"), ("b", "a")]
    for f in c.flows:
        assert f.nbytes == pytest.approx(2 * 2 * (3 - 1) / 3 * grads)   # tp rings x 2(D−1)/D x grads
        assert f.streams == 2 and f.latency == pytest.approx(0.020)     # two laps, one latency each
        assert f.stream_cap == pytest.approx(2**20 / 0.020)


def test_split_layers_in_proportion_to_speed_within_memory():
    assert split_layers(7, [1, 1, 1], [9, 9, 9]) == stage_layers(7, 3)
    assert split_layers(8, [1, 3], [9, 9]) == [2, 6]
    assert split_layers(8, [1, 3], [9, 5]) == [3, 5]          # the fast stage holds at most 5
    assert split_layers(8, [1, 3], [2, 5]) is None            # 7 layers fit, 8 do not
    assert split_layers(2, [1, 1, 1], [9, 9, 9]) is None      # more stages than layers


def test_memory_caps_and_fit():
    t = topology.parse(RAW)
    caps = layer_caps(t, M, ["a", "b"], tp=1, dp=2)
    per_layer = [M.stage_memory(1, 2, 1), M.stage_memory(1, 1, 1)]
    nccl = [nccl_memory(t, ["a", "b"], s, 1, 2, True) for s in range(2)]
    assert caps == [int((80 * 2**30 - nccl[s]) // per_layer[s]) for s in range(2)]
    lay = Layout(1, (("a",), ("b",)), (3, 3))
    assert memory(t, M, lay) == M.stage_memory(3, 2, 1) + nccl_memory(t, ["a", "b"], 0, 1, 1, False)
    assert fits(t, M, lay)
    big = ModelSpec(layers=2, hidden=32768, seq=512, global_batch=4)
    assert not fits(t, big, Layout(1, (("a",), ("b",)), (1, 1)))


def test_nccl_buffers_count_in_memory():
    """NCCL_BUFFSIZE for 8 Gb/s x 20 ms (20 MB in flight): 32 MiB under ATLAS, on every communicator of
    a GPU: world, dp, pp, mp, the embedding group on stages 0 and 2, and ATLAS's WAN pair and token ring
    at 1 -> 2. A stock launch keeps NCCL's 4 MiB and has no WAN groups."""
    t = topology.parse(RAW)
    lay = Layout(1, (("a", "a"), ("a", "a"), ("b", "b")), (2, 2, 2), atlas_runtime=True)
    comms = [5, 4 + 2, 5 + 2]
    assert [nccl_communicators(3, 1, 2, s, n) for s, n in enumerate([0, 1, 1])] == comms
    assert nccl_buffer_memory(32 * 2**20, 1) == 4 * 2 * 32 * 2**20      # both ways, two peers, 2 channels
    model = [M.stage_memory(2, min(3 - s, 4), 1) for s in range(3)]
    assert memory(t, M, lay) == pytest.approx(max(model[s] + nccl_buffer_memory(32 * 2**20, comms[s])
                                                  for s in range(3)))
    stock = replace(lay, atlas_runtime=False)
    assert memory(t, M, stock) == pytest.approx(max(
        model[s] + nccl_buffer_memory(4 * 2**20, nccl_communicators(3, 1, 2, s, 0)) for s in range(3)))
