"""benchmarks.moe_layer compares like with like: every row computes the same layer (same gate, same
experts, DeepSpeed's as tensor-parallel shards) and so the same output and input gradient."""

import pytest
import torch

from benchmarks import moe_layer as bench


@pytest.mark.world_size(4)
def test_rows_compute_the_same_layer(world):
    # k = 1 and a capacity no shard can fill: S1 routes like the others (parm.md §2.5), RTS draws are moot;
    # at most 1/8 of the slots hold a token, so skipping them (the rows without ALL_SLOTS) changes the work
    cfg = bench.Config(tokens=64, hidden=16, ffn=32, k=1, capacity_factor=8.0, chunks=2)
    rows = ("DeepSpeed MoE", "parm deepspeed", "parm s1", "parm s2", "parm auto", "parm s1" + bench.ALL_SLOTS,
            "parm s2" + bench.ALL_SLOTS)
    for outputs in world.run(bench._rank_outputs, cfg, rows):
        want_y, want_dx = outputs["DeepSpeed MoE"]
        for row in rows[1:]:
            y, dx = outputs[row]
            torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5, msg=row)
            torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-5, msg=row)


def test_grid_spans_both_regimes():
    configs = bench.grid_configs()
    assert len(configs) >= 12
    kf = {c.k * c.capacity_factor for c in configs}
    assert min(kf) < 1 < max(kf)  # S2 moves less over MP below k·f = 1, S1 above (parm.md §2.5)


def test_attribution_chains_paired_ratios():
    """Each step is the median of per-iteration ratios to the step above; the chain starts at DeepSpeed's
    MoE and its cumulative ratio is the paired speed-up of the last row (noise in one iteration cancels
    within the pair)."""
    ms = {"DeepSpeed MoE": [100, 200, 100], "parm deepspeed" + bench.ALL_SLOTS: [50, 100, 50],
          "parm s1" + bench.ALL_SLOTS: [40, 80, 40], "parm s1": [20, 40, 20],
          "parm s2" + bench.ALL_SLOTS: [50, 100, 25], "parm s2": [50, 50, 25]}
    steps = {(s["schedule"], s["step"]): s for s in bench.attribution(ms)}
    assert steps["s1", "`deepspeed` order with the fused dispatch"]["paired"] == 2.0
    assert steps["s1", "+ S1"]["paired"] == 1.25 and steps["s1", "+ skipping empty slots"]["paired"] == 2.0
    assert steps["s1", "+ skipping empty slots"]["cumulative"] == 5.0
    assert steps["s2", "+ S2"]["paired"] == 1.0 and steps["s2", "+ S2"]["row"] == "parm s2" + bench.ALL_SLOTS
    skip = steps["s2", "+ skipping empty slots"]
    assert skip["paired"] == 1.0 and skip["ms"] == 50
