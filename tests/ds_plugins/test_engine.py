"""ds_plugins.initialize: training steps equal plain deepspeed.initialize with DeepSpeed's MoE (ZeRO 0/1/2),
and bad configs fail with ValueError on every rank before anything communicates."""

from __future__ import annotations

import inspect

import deepspeed
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import nn

import ds_plugins
from ds_plugins import ParmMoE
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

S, M, H, E = 24, 8, 16, 8


class Net(nn.Module):
    def __init__(self, expert: nn.Module, ep: int, **moe_kwargs) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(M, M), nn.Linear(M, M)
        self.moe = MoE(M, expert, num_experts=E, ep_size=ep, enable_expert_tensor_parallelism=True,
                       **moe_kwargs)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        out, l_aux, _ = self.moe(h)
        return F.mse_loss(self.out(h + out), y) + 0.01 * l_aux


def _config(stage: int, parm: dict | None) -> dict:
    config = {"train_micro_batch_size_per_gpu": S, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.02, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "contiguous_gradients": True, "reduce_scatter": True}}
    if parm is not None:
        config["parm"] = parm
    return config


def _train(stage: int, parm: dict | None, steps: int = 3) -> list[float]:
    lay = use_layout(2, 2)
    torch.manual_seed(0)
    net = Net(mlp(M, H), 2, k=2, capacity_factor=4.0, min_capacity=0, top2_2nd_expert_sampling=False)
    init = deepspeed.initialize if parm is None else ds_plugins.initialize
    engine, *_ = init(model=net, model_parameters=net.parameters(), mpu=lay.mpu, config=_config(stage, parm))
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(lay.mpu.get_data_parallel_rank())  # one batch: loss must fall
        x, y = torch.randn(S, M, generator=g), torch.randn(S, M, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    swapped = [type(m).__name__ for m in engine.module.modules() if isinstance(m, MoE)]
    return losses, swapped


def _losses_both(stage: int, schedule: str, skip: bool):
    return _train(stage, None), _train(stage, {"enabled": True, "schedule": schedule, "overlap_chunks": 2,
                                               "skip_empty_slots": skip})


@pytest.mark.world_size(4)
@pytest.mark.parametrize(("stage", "schedule", "skip"),
                         [(0, "s1", True), (1, "s2", False), (2, "auto", True)])
def test_training_losses_equal_deepspeed(world, stage, schedule, skip):
    for (plain, plain_types), (parm, parm_types) in world.run(_losses_both, stage, schedule, skip):
        assert plain_types == ["MoE"] and parm_types == ["ParmMoE"]
        assert parm == pytest.approx(plain, rel=1e-5, abs=1e-6)
        assert plain[-1] < plain[0]  # it trains


class Unshardable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(M, M)

    def forward(self, x):
        return self.fc(x)


def _bad_configs() -> dict[str, str]:
    lay = use_layout(2, 2)
    cases = {
        "unknown key": (Net(mlp(M, H), 2), {"enabled": True, "pipeline_degree": 2}),
        "unknown schedule": (Net(mlp(M, H), 2), {"enabled": True, "schedule": "s3"}),
        "overlap_chunks < 1": (Net(mlp(M, H), 2), {"enabled": True, "overlap_chunks": 0}),
        "tp x ep does not divide the world": (Net(mlp(M, H), 4), {"enabled": True}),
        "unsupported expert": (Net(Unshardable(), 2), {"enabled": True}),
    }
    errors = {}
    for name, (net, parm) in cases.items():
        try:
            ds_plugins.initialize(model=net, model_parameters=net.parameters(), mpu=lay.mpu,
                                  config=_config(0, parm))
        except ValueError as e:
            errors[name] = str(e)
    return errors


@pytest.mark.world_size(4)
def test_bad_configs_raise_value_error_on_every_rank(world):
    for errors in world.run(_bad_configs):
        assert "pipeline_degree" in errors["unknown key"] and "allowed keys" in errors["unknown key"]
        assert "'s3'" in errors["unknown schedule"]
        assert "overlap_chunks=0" in errors["overlap_chunks < 1"]
        assert "2 x ep_size 4 = 8 must divide the world size 4" in errors["tp x ep does not divide the world"]
        assert "Unshardable" in errors["unsupported expert"] and "ESP size 2" in errors["unsupported expert"]


def test_layer_rejects_bad_arguments_before_any_collective():
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by ep_size=4"):
        ParmMoE(M, mlp(M, H), num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match="schedule='fast'"):
        ParmMoE(M, mlp(M, H), num_experts=4, schedule="fast")
    with pytest.raises(ValueError, match="overlap_chunks=0"):
        ParmMoE(M, mlp(M, H), num_experts=4, overlap_chunks=0)
    with pytest.raises(ValueError, match="skip_empty_slots='no' must be true or false"):
        ParmMoE(M, mlp(M, H), num_experts=4, skip_empty_slots="no")


def test_initialize_takes_exactly_deepspeeds_arguments():
    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(ds_plugins.initialize) == shape(deepspeed.initialize)


def test_swap_keeps_parameters_and_is_detected_as_moe():
    net = Net(mlp(M, H), 1)
    before = {name: p for name, p in net.named_parameters()}
    config = ds_plugins.ParmConfig(enabled=True, schedule="s2", skip_empty_slots=False)
    swapped = ds_plugins.engine.swap_moe_layers(net, config, 1, 1)
    assert isinstance(swapped.moe, ParmMoE) and isinstance(swapped.moe, MoE)
    assert swapped.moe.schedule == "s2" and swapped.moe.skip_empty_slots is False
    after = dict(swapped.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(getattr(p, "allreduce", True) is False for n, p in after.items() if "experts" in n)
    assert dist.is_available()


def _initialize_warnings(how: str, path: str) -> tuple[list[str], list[str]]:
    """(the Parm warnings, the MoE layers' types) of one initialize call with "parm" enabled."""
    import json
    import warnings

    lay = use_layout(2, 2)
    net = Net(mlp(M, H), 2, k=2, capacity_factor=4.0, min_capacity=0)
    config = _config(0, {"enabled": True})
    if how == "plain, file":          # a file per rank: ranks writing one path raced with each other's reads
        path = f"{path}.rank{dist.get_rank()}"
        with open(path, "w") as f:
            json.dump(config, f)
        config = path
    init = ds_plugins.initialize if how == "ds_plugins" else deepspeed.initialize
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = init(model=net, model_parameters=net.parameters(), mpu=lay.mpu, config=config)
    return ([str(w.message) for w in caught if "Parm is OFF" in str(w.message)],
            [type(m).__name__ for m in engine.module.modules() if isinstance(m, MoE)])


@pytest.mark.world_size(4)
@pytest.mark.parametrize("how", ["plain, dict", "plain, file", "ds_plugins"])
def test_plain_initialize_with_parm_enabled_warns_on_every_rank(world, tmp_path, how):
    """Not a silent no-op (issue 23 item 3): the plain call keeps DeepSpeed's MoE and says so on every rank;
    ds_plugins.initialize, which runs deepspeed.initialize itself, swaps and does not warn."""
    for caught, layers in world.run(_initialize_warnings, how, str(tmp_path / "ds.json")):
        if how == "ds_plugins":
            assert caught == [] and layers == ["ParmMoE"]
        else:
            assert len(caught) == 1 and "Call ds_plugins.initialize" in caught[0] and layers == ["MoE"]
