"""benchmarks.moe_layer compares like with like: every row computes the same layer (same gate, same
experts, DeepSpeed's as tensor-parallel shards) and so the same output and input gradient; and a benchmark
leaves DeepSpeed's process-wide state as it found it (the test worlds run DeepSpeed's engine after it)."""

import pytest
import torch
import torch.distributed as dist

from benchmarks import moe_layer as bench


class _SliceGrid:
    """An mpu as DeepSpeed's PipelineParallelGrid names it: the tensor-parallel group is the 'slice'."""

    def __init__(self, mpu) -> None:
        self.mpu = mpu

    def get_slice_parallel_world_size(self) -> int:
        return self.mpu.get_tensor_model_parallel_world_size()

    def get_slice_parallel_group(self):
        return self.mpu.get_tensor_model_parallel_group()


def _deepspeed_state() -> tuple:
    from deepspeed.moe import mappings
    from deepspeed.utils import groups

    return (groups.mpu, groups.expert_tensor_parallel_world_size, mappings._gather_tokens,
            [dict(getattr(groups, d)) for d in bench._EXPERT_DICTS])


def _outputs_and_state(cfg, rows) -> tuple:
    """The rows' outputs, whether DeepSpeed's state came back (a pipeline's grid and its ep_size_1 groups
    installed before), and the benchmark's token gather through such a grid against a plain all-gather."""
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu, groups.expert_tensor_parallel_world_size = _SliceGrid(None), 1
    groups._EXPERT_PARALLEL_GROUP["ep_size_1"] = "a pipeline stage's group"
    before = _deepspeed_state()
    outputs = bench._rank_outputs(cfg, rows)
    kept = _deepspeed_state() == before
    groups._EXPERT_PARALLEL_GROUP.pop("ep_size_1")
    groups.mpu = grid = _SliceGrid(bench._MPUS[cfg.tp])
    x = torch.arange(6.0).reshape(3, 2) + 10 * dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(cfg.tp)]
    dist.all_gather(parts, x, group=grid.get_slice_parallel_group())
    return outputs, kept, torch.equal(bench._gloo_gather_tokens(x, dim=1), torch.cat(parts, dim=1))


@pytest.mark.world_size(4)
def test_rows_compute_the_same_layer(world):
    # k = 1 and a capacity no shard can fill: S1 routes like the others (parm.md §2.5), RTS draws are moot;
    # at most 1/8 of the slots hold a token, so skipping them (the rows without ALL_SLOTS) changes the work
    cfg = bench.Config(tokens=64, hidden=16, ffn=32, k=1, capacity_factor=8.0, chunks=2)
    rows = ("DeepSpeed MoE", "parm deepspeed", "parm s1", "parm s2", "parm auto", "parm s1" + bench.ALL_SLOTS,
            "parm s2" + bench.ALL_SLOTS)
    for outputs, kept, gathered in world.run(_outputs_and_state, cfg, rows):
        assert kept and gathered
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
