"""Eval, inference and activation checkpointing (issue 9, item 1), on 4 gloo ranks (tp 2 x ep 2, ESP 2).

Every schedule, "auto" included, against DeepSpeed's MoE on the same weights and inputs:
- the layer: eval mode under ``torch.no_grad()`` and ``torch.inference_mode()`` (eval capacity factor 1.0,
  binding, training 2.0: the eval capacity is the one used), training mode under ``torch.no_grad()``, and
  forward + backward under reentrant and non-reentrant ``torch.utils.checkpoint`` and
  ``deepspeed.checkpointing``;
- the engine, in fp32 and bf16: ``engine.eval()`` forwards under ``torch.no_grad()`` and
  ``torch.inference_mode()``, training steps with the MoE under activation checkpointing, eval forwards
  again, loss by loss against DeepSpeed's MoE engine in the same precision (bf16: see the test).
"""

from __future__ import annotations

import math

import deepspeed
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import ds_plugins
from ds_plugins import ParmMoE
from tests.ds_plugins.deepspeed_oracle import LocalOracle, Weights, load_parm, mlp, use_layout
from tests.ds_plugins.test_engine import Net, _config

S, M, H, E = 24, 8, 16, 8
SCHEDULES = ("s1", "s2", "deepspeed", "auto")
GATE = dict(k=2, capacity_factor=2.0, eval_capacity_factor=1.0, min_capacity=0)


def _checkpointed(layer, x, how: str):
    if how == "torch-reentrant":
        return torch_checkpoint.checkpoint(layer, x, use_reentrant=True)
    if how == "torch-non-reentrant":
        return torch_checkpoint.checkpoint(layer, x, use_reentrant=False)
    if how == "deepspeed":
        return deepspeed.checkpointing.checkpoint(layer, x)
    return layer(x)


def _forward(layer, x, go, mode: str):
    """(output, input gradient or None, gate-weight gradient or None) of one call in ``mode``."""
    layer.zero_grad(set_to_none=True)
    layer.train(not mode.endswith("eval"))
    torch.manual_seed(7)
    if mode == "inference-eval":
        with torch.inference_mode():
            return layer(x)[0].clone(), None, None
    if mode.startswith("no_grad"):
        with torch.no_grad():
            return layer(x)[0], None, None
    xi = x.clone().requires_grad_()
    out, l_aux, _ = _checkpointed(layer, xi, mode)
    ((out * go).sum() + 0.5 * l_aux).backward()
    gate = layer.gate.wg.weight if isinstance(layer, ParmMoE) else layer.moe.gate.wg.weight
    return out.detach(), xi.grad, gate.grad


MODES = ("no_grad-eval", "inference-eval", "no_grad-train", "torch-reentrant", "torch-non-reentrant",
         "deepspeed")


def _layer_modes() -> dict:
    lay = use_layout(2, 2)
    deepspeed.checkpointing.configure(lay.mpu)
    w = Weights.random(E, M, H)
    torch.manual_seed(1000 + dist.get_rank() // 2)
    x, go = torch.randn(S, M), torch.randn(S, M)
    oracle = LocalOracle(w, **GATE)
    want = {mode: _forward(oracle, x, go, "plain" if mode in ("torch-reentrant", "torch-non-reentrant",
                                                                 "deepspeed") else mode) for mode in MODES}
    errors = {}
    for schedule in SCHEDULES:
        layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=2, enable_expert_tensor_parallelism=True,
                        schedule=schedule, overlap_chunks=2, **GATE)
        load_parm(layer, w)
        layer.set_deepspeed_parallelism()
        for mode in MODES:
            got = _forward(layer, x, go, mode)
            errors[schedule, mode] = max((a - b).abs().max().item()
                                         for a, b in zip(got, want[mode], strict=True) if a is not None)
    return errors


@pytest.mark.world_size(4)
def test_every_schedule_evaluates_and_checkpoints_like_deepspeed(world):
    for rank, errors in enumerate(world.run(_layer_modes)):
        assert set(errors) == {(s, m) for s in SCHEDULES for m in MODES}
        for key, err in errors.items():
            assert err < 2e-5, (rank, key, err)


class CheckpointedNet(Net):
    """test_engine's Net with its MoE layer under activation checkpointing."""

    def __init__(self, checkpointing: str, **moe_kwargs) -> None:
        super().__init__(mlp(M, H), 2, **moe_kwargs)
        self.checkpointing = checkpointing

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        out, l_aux, _ = _checkpointed(self.moe, h, self.checkpointing)
        return F.mse_loss(self.out(h + out), y) + 0.01 * l_aux


def _engine_run(schedule: str | None, dtype: str, checkpointing: str, steps: int = 2) -> list[float]:
    """Eval losses (under ``torch.no_grad()`` and ``torch.inference_mode()``), training losses, eval losses
    again and a last training loss."""
    lay = use_layout(2, 2)
    deepspeed.checkpointing.configure(lay.mpu)
    torch.manual_seed(0)
    gate = GATE if dtype == "fp32" else {**GATE, "eval_capacity_factor": GATE["capacity_factor"]}
    net = CheckpointedNet(checkpointing, **gate)
    config = _config(0, None if schedule is None else {"enabled": True, "schedule": schedule,
                                                       "overlap_chunks": 2})
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    init = deepspeed.initialize if schedule is None else ds_plugins.initialize
    engine, *_ = init(model=net, model_parameters=net.parameters(), mpu=lay.mpu, config=config)
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(lay.mpu.get_data_parallel_rank())
    x, y = (torch.randn(S, M, generator=g).to(cast) for _ in range(2))
    losses = []

    def evaluate():
        engine.eval()
        with torch.no_grad():
            losses.append(engine(x, y).float().item())
        with torch.inference_mode():
            losses.append(engine(x, y).float().item())
        engine.train()

    def train_step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())

    evaluate()
    for _ in range(steps):
        train_step()
    evaluate()
    train_step()
    return losses


# (schedule, checkpointing) per precision; DeepSpeed's MoE runs without checkpointing, which must not matter
RUNS = {"fp32": [("s1", "torch-reentrant"), ("s2", "torch-non-reentrant"), ("auto", "deepspeed"),
                 ("deepspeed", "none")],
        "bf16": [("s1", "torch-reentrant"), ("auto", "deepspeed")]}


def _engine_all(dtype: str) -> dict:
    out = {"deepspeed-moe": _engine_run(None, dtype, "none")}
    for schedule, checkpointing in RUNS[dtype]:
        out[schedule, checkpointing] = _engine_run(schedule, dtype, checkpointing)
    return out


@pytest.mark.slow
@pytest.mark.world_size(4)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_trains_and_evaluates_like_deepspeed(world, dtype):
    for rank, res in enumerate(world.run(_engine_all, dtype)):
        plain = res.pop("deepspeed-moe")
        assert plain[3] < plain[2]            # it trains
        for key, losses in res.items():
            where = (rank, key, losses, plain)
            if dtype == "fp32":
                assert losses == pytest.approx(plain, rel=1e-5, abs=1e-6), where
                continue
            # bf16: Parm reduce-scatters the experts' partial sums where DeepSpeed all-reduces whole outputs,
            # so sums round differently, within a bf16 ulp (2^-8, relative) of the loss. That holds while
            # the weights are identical (the evals and the first step); after an update the weights differ
            # by such roundings and a near-tie in the gate (Gumbel sampling) may route a token differently,
            # so later losses are checked to be finite and falling only.
            assert losses[:3] == pytest.approx(plain[:3], rel=2 ** -8), where
            assert all(math.isfinite(v) for v in losses) and losses[3] < losses[2], where
