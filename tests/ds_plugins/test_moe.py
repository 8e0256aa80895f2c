"""ParmMoE made from a DeepSpeed MoE (``from_moe``) against that MoE, on one rank: CPU, and one GPU."""

from __future__ import annotations

import pytest
import torch
from deepspeed.moe.layer import MoE

from ds_plugins import ParmConfig, ParmMoE
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

S, M, H, E = 32, 8, 16, 4


def _against_deepspeed(device: str, use_residual: bool, k: int) -> dict:
    use_layout(1, 1)

    def deepspeed_moe():
        torch.manual_seed(0)
        return MoE(M, mlp(M, H), num_experts=E, k=k, capacity_factor=1.0, min_capacity=0,
                   use_residual=use_residual)

    x, go = torch.randn(S, 2, M, device=device), torch.randn(S, 2, M, device=device)
    errors = {}
    for schedule in ("s1", "s2", "deepspeed", "auto"):
        parm = ParmMoE.from_moe(deepspeed_moe(), ParmConfig(schedule=schedule))
        layers = {"ds": deepspeed_moe(), "parm": parm}
        res = {}
        for name, layer in layers.items():
            layer.set_deepspeed_parallelism()
            layer.to(device)
            xi = x.clone().requires_grad_()
            torch.manual_seed(3)
            out, l_aux, counts = layer(xi)
            ((out * go).sum() + l_aux).backward()
            res[name] = (out, l_aux, counts, xi.grad, [p.grad for p in layer.parameters()])
        a, b = res["parm"], res["ds"]
        errors[schedule] = max([(a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().item(),
                                (a[3] - b[3]).abs().max().item()]
                               + [(p - q).abs().max().item() for p, q in zip(a[4], b[4], strict=True)])
        errors[schedule + " counts"] = torch.equal(a[2], b[2])
    return errors


@pytest.mark.world_size(1)
@pytest.mark.parametrize(("use_residual", "k"), [(False, 2), (True, 1)])
def test_from_moe_equals_deepspeed_on_one_rank(world, use_residual, k):
    errors = world.run(_against_deepspeed, "cpu", use_residual, k)[0]
    for key, value in errors.items():
        assert value is True if key.endswith("counts") else value < 1e-5, (key, value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.world_size(1, env={"DS_ACCELERATOR": "cuda"})
def test_from_moe_equals_deepspeed_on_one_gpu(world):
    errors = world.run(_against_deepspeed, "cuda", True, 2)[0]
    for key, value in errors.items():
        assert value is True if key.endswith("counts") else value < 1e-4, (key, value)
