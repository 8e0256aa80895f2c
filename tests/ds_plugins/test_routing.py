"""S2's debug check of routing across MP ranks (the routing itself: test_exact_routing, test_schedules)."""

import pytest
import torch
import torch.distributed as dist

from ds_plugins import ParmMoE
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout


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


@pytest.mark.parametrize(("k", "blocks"), [(1, 2), (2, 3), (3, 4)])
def test_a_block_of_full_batch_routes_keeps_its_routes_renumbered_from_zero(k, blocks):
    """routing.shard: each block's kept routes, per expert in their slot order, at slots 0, 1, ...; the
    capacity is the most routes one block sends one expert; dispatch -> combine is unchanged per token."""
    from ds_plugins.dispatch import combine, dispatch
    from ds_plugins.routing import Routes, shard
    from tests.ds_plugins.moe_routes import gate_routes

    full = gate_routes(k, 23, 8, 1.0, seed=k)           # binding capacity: some routes dropped
    r = Routes(torch.zeros(()), full.capacity, full.indices, full.locations, full.gates,
               torch.zeros(8, dtype=torch.int64))
    x = torch.randn(23, 5)
    want = combine(dispatch(x, r.indices, r.locations, 8, r.capacity), r.indices, r.locations, r.gates)
    most, rows = 0, 0
    for q, cols in enumerate(torch.arange(23).tensor_split(blocks)):
        mine, capacity = shard(r, q, blocks)
        assert torch.equal(mine.indices, r.indices[:, cols]) and torch.equal(mine.gates, r.gates[:, cols])
        live = mine.indices >= 0
        for e in range(8):
            was = r.locations[:, cols][mine.indices == e]
            now = mine.locations[mine.indices == e]
            assert torch.equal(now[was.argsort()], torch.arange(now.numel(), dtype=now.dtype))
            most = max(most, now.numel())
        assert capacity >= int(mine.locations[live].max()) + 1 if live.any() else capacity >= 1
        got = combine(dispatch(x[cols], mine.indices, mine.locations, 8, capacity), mine.indices,
                      mine.locations, mine.gates)
        torch.testing.assert_close(got, want[cols], rtol=0, atol=0)
        rows += cols.numel()
        assert shard(r, 0, blocks)[1] == capacity      # every block knows the largest
    assert rows == 23 and capacity == most and full.dropped > 0
