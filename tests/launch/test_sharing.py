"""Temporal WAN sharing: the replicas of a stage take turns on the link in (micro-batch, replica)
order; spatial sharing (the stock behaviour) lets them send at once."""

import time

import pytest
import torch
import torch.distributed as dist

from launch.sharing import TemporalSharing
from launch.striping import open_wan_groups
from launch.wan_p2p import WanP2P
from tests.launch.plans import two_dc_plan

LO = {"GLOO_SOCKET_IFNAME": "lo"}
CALLS, N, HOLD = 3, 1 << 20, 0.3


def _take_turns(sharing):
    """Stage 0 (ranks 0, 1) sends CALLS tensors forward, stage 1 (ranks 2, 3) CALLS tensors back.
    Replica 0's receivers post late (HOLD seconds), so a sender that does not wait for its turn
    finishes first. Each receiver reports when each transfer completed."""
    plan = two_dc_plan(connections=2, sharing=sharing)
    wan = WanP2P(open_wan_groups(plan, 2), TemporalSharing(plan) if sharing == "temporal" else None)
    me = dist.get_rank()
    stage, d, _ = plan.coord(me)
    peer = plan.rank(1 - stage, d)
    done = {}
    dist.barrier()
    t0 = time.monotonic()
    for direction in ("fwd", "bwd"):
        sending = (stage == 0) == (direction == "fwd")
        for call in range(CALLS):
            x = torch.full((N,), float(100 * call + me))
            if sending:
                wan.post_send(x, me, peer).wait()
            else:
                if d == 0:
                    time.sleep(HOLD)
                wan.post_recv(x, me, peer).wait()
                assert torch.equal(x, torch.full((N,), float(100 * call + peer)))
                done[(direction, call, d)] = time.monotonic() - t0
        dist.barrier()
    wan.undo()
    return done


@pytest.mark.world_size(4, env=LO)
def test_temporal_sharing_serialises_in_token_order(world):
    done = {k: v for r in world.run(_take_turns, "temporal") for k, v in r.items()}
    for direction in ("fwd", "bwd"):
        order = sorted((k for k in done if k[0] == direction), key=done.get)
        # (micro-batch, replica) order although replica 1's receiver was ready HOLD seconds earlier
        assert order == [(direction, c, d) for c in range(CALLS) for d in range(2)]


@pytest.mark.world_size(4, env=LO)
def test_spatial_sharing_does_not_wait(world):
    done = {k: v for r in world.run(_take_turns, "spatial") for k, v in r.items()}
    for direction in ("fwd", "bwd"):
        assert done[(direction, 0, 1)] < done[(direction, 0, 0)] - HOLD / 2
