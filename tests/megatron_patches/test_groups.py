"""groups.subgroup: a members-only group whose torch name a live group already has (the group count
went back after groups were destroyed, as Megatron's destroy_model_parallel does) is still made, on
every member alike, and works."""

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from megatron_patches.groups import _name_taken, subgroup


def _remake_after_destroy():
    me = dist.get_rank()
    pair = [me - me % 2, me - me % 2 + 1]
    mine = comm.new_group([me], local_sync=True)   # a group made before the first pair group ...
    first = subgroup(pair, "test.pair")
    dist.destroy_process_group(mine)                # ... and destroyed: the count goes back by one
    clash = _name_taken(pair)
    second = subgroup(pair, "test.pair")
    sums = []
    for group in (first, second):
        t = torch.tensor([float(me)])
        comm.all_reduce(t, group)
        sums.append(t.item())
    return clash, sums, second is not first


@pytest.mark.world_size(4)
def test_a_group_whose_name_is_taken_is_still_made(world):
    for r, (clash, sums, distinct) in enumerate(world.run(_remake_after_destroy)):
        assert clash, "the scenario must reproduce the clash"
        pair_sum = float(2 * (r - r % 2) + 1)
        assert sums == [pair_sum, pair_sum] and distinct
