"""The schedule changes the speed, never the result (issue 9, item 2), on 4 gloo ranks (tp 2 x ep 2, ESP 2).

- With token dropping and a binding capacity (capacity factor 1.0), S1, S2 and "auto" keep and drop exactly
  the routes DeepSpeed's gate keeps and drops on the full batch: outputs, l_aux, exp_counts and every
  gradient equal DeepSpeed's MOELayer on all S tokens, for top-1 with random token selection, top-2 with
  Gumbel sampling, top-k with the 'probs' drop policy, 'Jitter' and 'RSample', with S % N != 0 too; and
  every rank ends the forward with DeepSpeed's RNG state (so MP peers stay identical).
- Through the engine: 3 training steps, capacity factor 1.0, k = 2, S = 23 tokens per rank: S1, S2 and
  "auto" give DeepSpeed's MoE losses, loss by loss, and its RNG state.
- "auto" MoE layers in both stages of a DeepSpeed PipelineModule (2 stages x tp 2) train several steps
  with the losses of DeepSpeed's MoE: the forward issues no collective outside the layer's own groups.
"""

from __future__ import annotations

import hashlib

import deepspeed
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups
from torch import nn

import ds_plugins
from ds_plugins import ParmMoE, routing, selector
from tests.ds_plugins.deepspeed_oracle import LocalOracle, Weights, load_parm, mlp, tp_rank, use_layout
from tests.ds_plugins.test_engine import Net, _config
from tests.ds_plugins.test_schedules import _grads, _linears, _sum_over_sources

M, H, E, TP, EP = 8, 16, 8, 2, 2

# (name, schedule, k, tokens, gate options); capacity factor 1.0: C = ceil(k·S / E) binds
CASES = [
    ("s1-k1-rts", "s1", 1, 23, {}),
    ("s1-k2-sampling", "s1", 2, 23, {}),
    ("s1-k3-probs", "s1", 3, 24, {}),
    ("s1-k2-jitter", "s1", 2, 24, {"noisy_gate_policy": "Jitter"}),
    ("s1-k1-rsample", "s1", 1, 23, {"noisy_gate_policy": "RSample"}),
    ("s2-k2-jitter", "s2", 2, 23, {"noisy_gate_policy": "Jitter"}),
    ("auto-k2", "auto", 2, 23, {}),
]


def _digest(state: torch.Tensor) -> str:
    return hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16]


def _run(layer, x, go):
    x = x.clone().requires_grad_()
    torch.manual_seed(7)
    out, l_aux, counts = layer(x)
    rng = _digest(torch.get_rng_state())
    ((out * go).sum() + 0.5 * l_aux).backward()
    return out.detach(), l_aux.detach(), counts, x.grad, rng


def _layer_case(case) -> dict:
    _, schedule, k, tokens, options = case
    w = Weights.random(E, M, H)
    torch.manual_seed(1000 + dist.get_rank() // TP)  # one input per MP group
    x, go = torch.randn(tokens, M), torch.randn(tokens, M)
    kw = dict(k=k, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0, **options)
    parm = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=EP, enable_expert_tensor_parallelism=True,
                   schedule=schedule, overlap_chunks=2, **kw)
    load_parm(parm, w)
    parm.set_deepspeed_parallelism()
    got = _run(parm, x, go)
    oracle = LocalOracle(w, **kw)
    want = _run(oracle, x, go)
    torch.manual_seed(7)
    dropped = int((routing.route(oracle.moe.gate, x).indices < 0).sum())
    q, hs = tp_rank(), H // TP
    first = parm.parm_groups.ep_rank * parm.num_local_experts
    _sum_over_sources(oracle, parm.deepspeed_moe.ep_group, TP)
    ref_experts = [_grads(*_linears(oracle.expert(first + j)), slice(q * hs, (q + 1) * hs))
                   for j in range(parm.num_local_experts)]
    return {"schedule": parm.last_schedule, "dropped": dropped, "scale": want[0].abs().max().item(),
            "out": (got[0] - want[0]).abs().max().item(), "l_aux": abs(got[1].item() - want[1].item()),
            "counts_equal": torch.equal(got[2].long(), want[2].long()),
            "grad_x": (got[3] - want[3]).abs().max().item(),
            "grad_gate": (parm.gate.wg.weight.grad - oracle.moe.gate.wg.weight.grad).abs().max().item(),
            "grad_experts": max((a - b).abs().max().item()
                                for ex, ref in zip(parm.local_experts, ref_experts, strict=True)
                                for a, b in zip(_grads(*_linears(ex)), ref, strict=True)),
            "rng_equal": got[4] == want[4]}


def _layer_cases(names: list[str]) -> dict:
    use_layout(TP, EP)
    return {case[0]: _layer_case(case) for case in CASES if case[0] in names}


@pytest.mark.world_size(4)
def test_every_schedule_drops_what_deepspeeds_gate_drops_on_the_full_batch(world):
    for rank, res in enumerate(world.run(_layer_cases, [c[0] for c in CASES])):
        for name, err in res.items():
            where = f"rank {rank} case {name}: {err}"
            assert err["dropped"] > 0, where                      # the capacity binds
            assert err["counts_equal"] and err["rng_equal"], where
            for key in ("out", "l_aux", "grad_x", "grad_gate", "grad_experts"):
                assert err[key] <= 2e-5 * max(1.0, err["scale"]), where
        assert res["auto-k2"]["schedule"] in ("s1", "s2", "deepspeed")


def _engine_losses(schedule: str | None, tokens: int, steps: int = 3):
    lay = use_layout(TP, EP)
    torch.manual_seed(0)
    net = Net(mlp(M, H), EP, k=2, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0)
    parm = None if schedule is None else {"enabled": True, "schedule": schedule, "overlap_chunks": 2}
    init = deepspeed.initialize if parm is None else ds_plugins.initialize
    engine, *_ = init(model=net, model_parameters=net.parameters(), mpu=lay.mpu, config=_config(0, parm))
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + lay.mpu.get_data_parallel_rank())
        x, y = torch.randn(tokens, M, generator=g), torch.randn(tokens, M, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, _digest(torch.get_rng_state())


def _engine_all(tokens: int) -> dict:
    return {s: _engine_losses(s, tokens) for s in (None, "s1", "s2", "auto")}


@pytest.mark.slow
@pytest.mark.world_size(4)
def test_engine_losses_equal_deepspeed_at_a_binding_capacity(world):
    # S = 23: S % N = 1 and C = ceil(2·23/8) = 6, divisible by tp as DeepSpeed's own TP path requires
    for rank, res in enumerate(world.run(_engine_all, 23)):
        plain, plain_rng = res[None]
        for schedule in ("s1", "s2", "auto"):
            losses, rng = res[schedule]
            assert losses == pytest.approx(plain, rel=1e-5, abs=1e-6), (rank, schedule, losses, plain)
            assert rng == plain_rng, (rank, schedule)


class _Block(nn.Module):
    """A pipeline stage's layer: h + MoE(tanh(W h)) (the MoE's l_aux stays in its stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(M, M)
        self.moe = MoE(M, mlp(M, H), num_experts=4, ep_size=1, k=2, capacity_factor=1.0, min_capacity=0,
                       enable_expert_tensor_parallelism=True)

    def forward(self, h):
        out, _, _ = self.moe(torch.tanh(self.inp(h)))
        return h + out


def _pipeline_losses(parm: dict | None, steps: int = 3) -> tuple[list[float], list]:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend="gloo")
    for d in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
              "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        getattr(groups, d).pop("ep_size_1", None)  # DeepSpeed builds them per pipeline stage
    selector._fitted.clear()
    selector._decisions.clear()
    torch.manual_seed(0)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=TP, num_dp=1)
    model = PipelineModule(layers=[_Block(), _Block()], topology=topo, loss_fn=F.mse_loss,
                           partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.02, "torch_adam": True}}}
    if parm is not None:
        config["parm"] = parm
    init = deepspeed.initialize if parm is None else ds_plugins.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(24, M, generator=g), torch.randn(24, M, generator=g)) for _ in range(2 * steps)]
    it = iter(batches)
    losses = [engine.train_batch(data_iter=it).item() for _ in range(steps)]
    chosen = [m.last_schedule for m in engine.module.modules() if isinstance(m, ParmMoE)]
    return losses, chosen


def _pipeline_both() -> dict:
    return {"deepspeed": _pipeline_losses(None), "auto": _pipeline_losses({"enabled": True})}


@pytest.mark.slow
@pytest.mark.world_size(4)
def test_auto_trains_in_both_stages_of_a_pipeline(world):
    for rank, res in enumerate(world.run(_pipeline_both)):
        plain, _ = res["deepspeed"]
        losses, chosen = res["auto"]
        # one MoE per stage
        assert len(chosen) == 1 and chosen[0] in ("s1", "s2", "deepspeed"), (rank, chosen)
        assert losses == pytest.approx(plain, rel=1e-5, abs=1e-6), (rank, losses, plain)
