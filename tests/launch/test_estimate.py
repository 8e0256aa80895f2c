"""The planner's estimator: per-layer formulas, the layout's pipeline, closed form vs simulator."""

import pytest

from launch import topology
from launch.estimate import ModelSpec, analytic, layout_pipeline, stage_layers
from launch.simulate import simulate
from launch.sockets import nccl_buffer_memory, nccl_communicators

RAW = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": 4}], "gpu_tflops": 100, "gpu_memory_gb": 80,
                             "node_bandwidth_gbps": 800, "intra_bandwidth_gbps": 80},
                       "b": {"hosts": [{"name": "b0", "slots": 4}]}},
       "wan": [{"between": ["a", "b"], "rtt_ms": 20, "bandwidth_gbps": 8, "window_mb": 1}]}
M = ModelSpec(layers=6, hidden=1024, seq=512, global_batch=16, micro_batch=2)


def test_model_formulas():
    assert M.layer_params == 12 * 1024**2
    assert M.layer_flops == 24 * 2 * 512 * 1024**2 + 4 * 2 * 512**2 * 1024
    assert M.act_bytes == 2 * 512 * 1024 * 2
    assert M.micro_batches(dp=2) == 4
    assert stage_layers(7, 3) == [3, 2, 2]


def test_layout_pipeline_costs():
    t = topology.parse(RAW)
    pipe, memory = layout_pipeline(t, M, ["a", "a", "b"], tp=1, dp=2, connections=4, sharing="temporal",
                                   window=2**20)
    compute = 2 * M.layer_flops / 100e12                       # 2 layers per stage, 100 TFLOP/s, tp=1
    assert pipe.t_f == pytest.approx([compute] * 3) and pipe.t_b == pytest.approx([2 * compute] * 3)
    intra, wan = pipe.links
    assert not intra.shared and intra.bandwidth == 80e9 / 8
    # WAN: 8 Gb/s shared, one transfer capped at tp x 4 connections x 1 MiB / 20 ms
    assert wan.shared and wan.bandwidth == 1e9 and wan.per_transfer_cap == pytest.approx(4 * 2**20 / 0.020)
    params = 2 * M.layer_params
    # NCCL_BUFFSIZE for 8 Gb/s x 20 ms (20 MB in flight): 32 MiB, on every communicator of a GPU: world,
    # dp, pp, mp, the embedding group on stages 0 and 2, and ATLAS's WAN pair and token ring at 1 -> 2
    comms = [5, 4 + 2, 5 + 2]
    stages = [params * 16 + min(3 - s, M.micro_batches(2)) * 2 * 34 * 512 * 2 * 1024   # 1F1B keeps 3 - s
              + nccl_buffer_memory(32 * 2**20, comms[s]) for s in range(3)]
    assert [nccl_communicators(3, 1, 2, s, n) for s, n in enumerate([0, 1, 1])] == comms
    assert nccl_buffer_memory(32 * 2**20, 1) == 4 * 2 * 32 * 2**20      # both ways, two peers, 2 channels
    assert memory == pytest.approx(max(stages))


def test_closed_form_matches_the_simulator_without_communication():
    t = topology.parse({**RAW, "wan": [{"between": ["a", "b"], "rtt_ms": 1e-9, "bandwidth_gbps": 1e12}]})
    pipe, _ = layout_pipeline(t, M, ["a", "a", "a"], tp=1, dp=1, connections=1, sharing="temporal",
                              window=2**40)
    free = type(pipe)(pipe.t_f, pipe.t_b, [type(link)(0.0, float("inf")) for link in pipe.links],
                      pipe.act_bytes, pipe.micro_batches)
    assert analytic(free) == pytest.approx(simulate(free).iteration)
