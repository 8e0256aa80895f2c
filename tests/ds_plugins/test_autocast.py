"""Mixed precision through autocast (issue 23 item 1): DeepSpeed's ``"torch_autocast"`` section and
``torch.autocast`` in the user's code, every schedule against stock DeepSpeed's MoE, loss by loss, on
4 CPU ranks (tp 2, ESP 2, ep 2).

Under bf16 autocast the gate's GEMM, the experts' Linears and the model's own run in bf16; DeepSpeed's MoE
computes the gate's softmax and top-k on those logits, widens the gates to fp32 and weights and sums each
token's routes in fp32 (``_sparse_decode``), then casts back to the experts' dtype. Parm combines in the
same precision (DeepSpeed multiplies its bf16 gates by the bf16 expert outputs before its fp32 sum; Parm
widens the gates first, so its products are not rounded to bf16), so the two agree to bf16 rounding: the
tolerance, rel 1e-2 per loss over 3 steps, is 2.6 bf16 ulps (2**-8 = 3.9e-3) of the losses' O(1)
magnitude. Measured here: at most 2.1e-4 with DeepSpeed's section (which leaves the loss in fp32), 6.2e-3
with autocast around the whole step (the loss itself in bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.ds_plugins import training
from tests.ds_plugins.training import LayerSpec

SCHEDULES = {"deepspeed-config": ("s1", "s2", "deepspeed", "auto"),
             "user-code": ("s1", "s2")}   # S1's sharded gate and S2's whole one (the deepspeed order's too)
LAYERS = (LayerSpec(k=2, capacity_factor=4.0),)
BF16 = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
REL = 1e-2


def _train_user_autocast(engine, mpu) -> list[float]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return training.train(engine, mpu, 0, 3)


def _losses(where: str) -> dict:
    section, user = (BF16, False) if where == "deepspeed-config" else ({}, True)
    train = _train_user_autocast if user else (lambda engine, mpu: training.train(engine, mpu, 0, 3))
    engine, mpu = training.build(LAYERS, None, 1, **section)
    out = {"deepspeed-moe": train(engine, mpu)}
    for schedule in SCHEDULES[where]:
        engine, mpu = training.build(LAYERS, {"enabled": True, "schedule": schedule, "overlap_chunks": 2}, 1,
                                     **section)
        out[schedule] = train(engine, mpu)
    return out


@pytest.mark.slow
@pytest.mark.world_size(4)
@pytest.mark.parametrize("where", list(SCHEDULES))
def test_every_schedule_trains_under_bf16_autocast_as_deepspeed_moe(world, where):
    for losses in world.run(_losses, where):
        want = losses.pop("deepspeed-moe")
        assert len(set(want)) == len(want), want
        for schedule, got in losses.items():
            assert got == pytest.approx(want, rel=REL), (schedule, got, want)
