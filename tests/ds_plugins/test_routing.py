"""Routing helpers: the gate's drop-mode capacity, and S2's debug check of routing across MP ranks."""

import pytest
import torch
import torch.distributed as dist
from deepspeed.moe.sharded_moe import TopKGate

from ds_plugins import ParmMoE, routing
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout


@pytest.mark.parametrize(("k", "cf", "tokens"), [(1, 1.0, 24), (2, 1.25, 26), (3, 0.5, 100), (2, 2.0, 7)])
def test_drop_capacity_is_the_gates(k, cf, tokens):
    gate = TopKGate(8, 4, k, cf, cf, 0, None, True, True, None, False)
    assert routing.drop_capacity(gate, tokens) == routing.route(gate, torch.randn(tokens, 8)).capacity


def _inconsistent_rng() -> str:
    use_layout(2, 2)
    layer = ParmMoE(8, mlp(8, 16), num_experts=4, ep_size=2, k=2, enable_expert_tensor_parallelism=True,
                    schedule="s2", debug=True)
    layer.set_deepspeed_parallelism()
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    torch.manual_seed(dist.get_rank())  # MP peers draw different Gumbel noise for the second expert
    try:
        layer(x)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.world_size(4)
def test_debug_mode_catches_routing_that_differs_across_mp_ranks(world):
    for message in world.run(_inconsistent_rng):
        assert "routing differs across MP ranks" in message
