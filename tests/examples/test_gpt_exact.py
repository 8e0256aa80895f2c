"""The main job computes what one process computes: its 4-rank training (context parallel 4, MoE teams of
2, expert parallel 2, ZeRO-1) gives the SGD losses of a single-process model with full attention and a dense
top-2 MoE, with the features on (Parm, WallFacer C=2) and off (DeepSpeed's MoE, ring attention). This is
the check of the gradient bookkeeping of examples/gpt/layout.py: a wrong scale on any parameter group
(world-wide reduction, the gate shared by the MP ranks, the auxiliary loss) moves the losses by far more
than the tolerance from the second step on (without the gate's 1/tp: 4e-4 at step 1, 1.4% at step 3)."""

from __future__ import annotations

import pytest

from examples.gpt import data
from tests.examples.gpt_reference import reference_losses

SIZES = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--experts", "4", "--seq", "64",
         "--batch", "2", "--steps", "4", "--eval-every", "100", "--eval-batches", "1", "--sample-bytes", "0",
         "--warmup-steps", "1", "--aux-loss-coef", "0.1"]
LR = 0.5


def _config(parm: dict) -> dict:
    # SGD: its step is linear in the gradient, so a wrong gradient scale shows (Adam would hide any
    # per-parameter constant factor, and it blows rounding noise on zero gradients up to full steps).
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True, "parm": parm}


_CORPUS = {}


def _corpus() -> data.Corpus:
    if "c" not in _CORPUS:
        _CORPUS["c"] = data.Corpus.load()
    return _CORPUS["c"]


def _job_losses(parm: dict, team_size: int) -> list[float]:
    from examples.gpt.layout import SequenceParallelUnit, deepspeed_moe_on_gloo
    from examples.gpt.train import Job
    from examples.train_gpt import parse

    args = parse(SIZES)
    args.ep = 2
    deepspeed_moe_on_gloo()
    job = Job(args, _corpus(), _MPU.get("mpu") or _MPU.setdefault("mpu", SequenceParallelUnit(args.tp)))
    return job.train("test", _config(parm), team_size).losses


_MPU = {}


@pytest.mark.slow
@pytest.mark.world_size(4)
def test_job_losses_equal_one_process(world):
    from examples.train_gpt import parse

    args = parse(SIZES)
    args.ep = 2
    expected = reference_losses(args, _corpus(), 4, LR)
    on = world.run(_job_losses, {"enabled": True, "schedule": "s1", "overlap_chunks": 2}, 2)
    off = world.run(_job_losses, {"enabled": False}, 1)
    for losses in (on, off):
        assert all(r == losses[0] for r in losses)          # every rank reports the world's mean
        assert losses[0] == pytest.approx(expected, rel=2e-5), (losses[0], expected)
    assert expected[-1] < expected[0]
