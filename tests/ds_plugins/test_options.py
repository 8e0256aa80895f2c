"""The experts and MoE options people use, through the engine on 4 CPU ranks (tp 2, ESP = 2), against
DeepSpeed's own MoE with the same model code (issue 9 item 5): SwiGLU experts, top-k > 2, noisy gates,
use_residual, drop_tokens=False, two MoE layers with different ep sizes; use_tutel refused; the MoE
timers of wall_clock_breakdown.

Each case trains 3 steps with plain DeepSpeed and with Parm from the same weights and batches and compares
the losses step by step (outputs, l_aux and every gradient feed into them through the Adam updates).
"""

from __future__ import annotations

import logging
import re

import pytest
from deepspeed.utils import logger

import ds_plugins
from ds_plugins import ParmMoE
from tests.ds_plugins import training
from tests.ds_plugins.deepspeed_oracle import mlp
from tests.ds_plugins.training import LayerSpec

ALL = ("s1", "s2", "deepspeed", "auto")
"""Every schedule routes as DeepSpeed's gate does on the full batch (S1 too: it gates the whole batch on
every MP rank), so noise and binding capacities give DeepSpeed's losses with each of them."""

# S = 16 tokens, E = 8: capacity ceil(2·k·f); DeepSpeed's tensor-parallel MoE needs it even (it splits the
# capacity over tp = 2).
CASES = {
    "swiglu": ((LayerSpec(expert="swiglu"),), ALL),
    "swiglu-k1-binding": ((LayerSpec(expert="swiglu", k=1, capacity_factor=1.0),), ALL),
    "top3": ((LayerSpec(k=3),), ALL),
    "top3-binding": ((LayerSpec(k=3, capacity_factor=1.0),), ALL),
    "jitter": ((LayerSpec(noisy_gate_policy="Jitter", capacity_factor=1.0),), ALL),
    "rsample-k1": ((LayerSpec(k=1, noisy_gate_policy="RSample", capacity_factor=2.0),), ALL),
    "residual": ((LayerSpec(use_residual=True),), ALL),
    # without dropping, DeepSpeed pads its capacity to a multiple of tp only when the experts are not
    # tensor-parallel (sharded, an odd largest count trips its own assert): ESP = 1 here, MP = 2
    "no-drop-esp1": ((LayerSpec(drop_tokens=False, capacity_factor=1.0, shard=False),), ALL),
    "two-layers-ep1-ep2": ((LayerSpec(ep=1, expert="swiglu"), LayerSpec(ep=2, k=1, capacity_factor=8.0)),
                           ALL),
}


def _losses(layers, schedules) -> dict:
    out = {}
    engine, mpu = training.build(layers, None, 1)
    out["deepspeed-moe"] = training.train(engine, mpu, 0, 3)
    for schedule in schedules:
        engine, mpu = training.build(layers, {"enabled": True, "schedule": schedule, "overlap_chunks": 2}, 1)
        assert all(type(m).__name__ == "ParmMoE" for m in engine.module.moes)
        out[schedule] = training.train(engine, mpu, 0, 3)
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", list(CASES))
def test_parm_trains_as_deepspeed_moe(world, case):
    layers, schedules = CASES[case]
    for losses in world.run(_losses, layers, schedules):
        want = losses.pop("deepspeed-moe")
        assert len(set(want)) == len(want), want  # the weights move
        for schedule, got in losses.items():
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (schedule, got, want)


def test_use_tutel_is_refused_before_anything_communicates():
    with pytest.raises(ValueError, match=r"use_tutel=True: ParmMoE does not run Tutel.*set use_tutel=False"):
        ParmMoE(8, mlp(8, 16), num_experts=4, use_tutel=True)


def _tutel_swap() -> str:
    mpu = training.use_layouts(2, [(2, True)])
    net = training.Net((LayerSpec(),))
    net.moes[0].deepspeed_moe.use_tutel = True  # what DeepSpeed keeps when Tutel is installed
    try:
        ds_plugins.initialize(model=net, model_parameters=net.parameters(), mpu=mpu,
                              config=training.config(0, {"enabled": True}))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.world_size(4)
def test_use_tutel_is_refused_on_every_rank_by_initialize(world):
    assert all("use_tutel=True" in msg for msg in world.run(_tutel_swap))


def _timers(parm: dict | None) -> list[str]:
    """The engine's forward breakdown lines (logged by rank 0) of two steps."""
    lines, level = [], logger.level
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # DeepSpeed logs the breakdown at INFO
    try:
        engine, mpu = training.build((LayerSpec(),), parm, 0, wall_clock_breakdown=True)
        training.train(engine, mpu, 0, 2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [line for line in lines if "fwd_moe" in line]


BREAKDOWN = re.compile(r"fwd: ([\d.]+) \(fwd_moe: ([\d.]+), 1st_a2a: ([\d.]+), 2nd_a2a: ([\d.]+), "
                       r"top_k: ([\d.]+)\)")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("schedule", ["s1", "s2"])
def test_wall_clock_breakdown_reports_parm_times(world, schedule):
    """The engine's MoE breakdown ``time (ms) | fwd: .. (fwd_moe: .., 1st_a2a: .., 2nd_a2a: .., top_k: ..)``
    reads real times from a ParmMoE, as from DeepSpeed's MoE: positive, the parts within the layer, the
    layer within the first step's forward (the MoE timers add up over steps, the engine's restart)."""
    for parm in ({"enabled": True, "schedule": schedule}, None):
        lines = world.run(_timers, parm)[0]
        assert len(lines) == 2, lines
        fwd, moe, first, second, gate = map(float, BREAKDOWN.search(lines[0]).groups())
        assert min(moe, first, second, gate) > 0 and first + second + gate < moe <= fwd, (parm, lines)
        assert float(BREAKDOWN.search(lines[1]).group(2)) > moe, (parm, lines)
