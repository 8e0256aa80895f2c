"""Every size a collective depends on is agreed over every group it uses (issue 9, item 3), on 4 gloo ranks
(tp 2 x ep 2, ESP 2): inputs or routing that differ where they must not raise the same clear error on
every rank instead of hanging, the world stays usable afterwards, and set-up runs once per layer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_plugins import ParmMoE
from tests.ds_plugins.deepspeed_oracle import LocalOracle, Weights, load_parm, mlp, tp_rank, use_layout
from tests.ds_plugins.test_schedules import _run

S, M, H, E = 24, 8, 16, 8


def _layer(schedule: str, drop: bool = True, w: Weights | None = None) -> ParmMoE:
    use_layout(2, 2)
    torch.manual_seed(0)
    layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=2, k=2, capacity_factor=1.0, min_capacity=0,
                    drop_tokens=drop, enable_expert_tensor_parallelism=True, schedule=schedule)
    if w is not None:
        load_parm(layer, w)
    layer.set_deepspeed_parallelism()
    return layer


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _healthy() -> bool:
    """A normal forward + backward after the errors: nothing hung, no rank is a collective behind."""
    layer = _layer("s1")
    torch.manual_seed(dist.get_rank() // 2)
    out, l_aux, _ = layer(torch.randn(S, M))
    (out.sum() + l_aux).backward()
    return True


def _divergent_routing(schedule: str) -> str:
    """No token dropping; MP rank 1 routes every token to one expert, its MP peer does not: the capacity
    (the largest expert count) differs across the MP ranks of a group."""
    layer = _layer(schedule, drop=False)
    torch.manual_seed(dist.get_rank() // 2)
    x = torch.randn(S, M)
    if tp_rank() == 1:
        x = 10 * layer.gate.wg.weight[0].detach().expand(S, M).clone()
    return _error(lambda: layer(x))


def _token_counts() -> dict:
    torch.manual_seed(1)
    big = 24 if dist.get_rank() // 2 == 0 else 20                   # MP group {0,1} vs {2,3}: EP peers differ
    errors = {"mp": _error(lambda: _layer("s1")(torch.randn(24 + tp_rank(), M))),
              "ep drop": _error(lambda: _layer("s2")(torch.randn(big, M)))}
    layer = _layer("s2")
    layer.train(dist.get_rank() != 3)
    errors["train/eval"] = _error(lambda: layer(torch.randn(S, M)))
    return errors


def _ep_counts_without_dropping(schedule: str) -> float:
    """drop_tokens=False: EP peers may hold different token counts (the capacity is their MAX)."""
    w = Weights.random(E, M, H)
    layer = _layer(schedule, drop=False, w=w)
    torch.manual_seed(1000 + dist.get_rank() // 2)
    tokens = 24 if dist.get_rank() // 2 == 0 else 19
    x, go = torch.randn(tokens, M), torch.randn(tokens, M)
    got = _run(layer, x, go)
    want = _run(LocalOracle(w, k=2, capacity_factor=1.0, min_capacity=0, drop_tokens=False), x, go)
    return max((got[0] - want[0]).abs().max().item(), (got[3] - want[3]).abs().max().item())


def _all() -> dict:
    out = {f"routing {s}": _divergent_routing(s) for s in ("s2", "deepspeed")}
    out.update(_token_counts())
    out["no-drop error"] = {s: _ep_counts_without_dropping(s) for s in ("s1", "s2", "deepspeed")}
    out["healthy"] = _healthy()
    return out


@pytest.mark.world_size(4)
def test_disagreements_raise_the_same_error_on_every_rank(world):
    for rank, res in enumerate(world.run(_all)):
        for schedule in ("s2", "deepspeed"):
            assert res[f"routing {schedule}"].startswith("RuntimeError: parm MoE: routing differs across the "
                                                         "tensor-parallel (MP) ranks"), (rank, res)
        assert "MP) ranks of this layer hold different token counts (between 24 and 25)" in res["mp"], rank
        assert "drop_tokens=True every rank" in res["ep drop"] and "between 20 and 24" in res["ep drop"], rank
        assert "others in eval mode" in res["train/eval"], rank
        for schedule, err in res["no-drop error"].items():
            assert err < 2e-5, (rank, schedule, err)
        assert res["healthy"]


def _set_up_twice() -> dict:
    layer = _layer("auto")
    shapes = [tuple(p.shape) for p in layer.parameters()]
    error = _error(layer.set_deepspeed_parallelism)
    torch.manual_seed(dist.get_rank() // 2)
    layer(torch.randn(S, M))
    return {"error": error, "same shapes": shapes == [tuple(p.shape) for p in layer.parameters()],
            "sharded": layer.local_experts[0][0].out_features}


@pytest.mark.world_size(4)
def test_a_second_set_up_fails_clearly_and_never_shards_twice(world):
    for res in world.run(_set_up_twice):
        assert res["error"].startswith("RuntimeError: ParmMoE.set_deepspeed_parallelism() was already called")
        assert res["same shapes"] and res["sharded"] == H // 2
