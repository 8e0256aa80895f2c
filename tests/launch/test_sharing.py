"""Temporal WAN sharing: the replicas of a stage hold the link one at a time, in (micro-batch,
replica) order, in both directions; spatial sharing (the stock behaviour) passes no token."""

import time
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from commweave.ledger import recording
from launch.sharing import TemporalSharing
from launch.striping import open_wan_groups
from launch.wan_p2p import WanP2P
from tests.launch.plans import two_dc_plan

LO = {"GLOO_SOCKET_IFNAME": "lo"}
CALLS, N, HOLD = 3, 1 << 20, 0.2


def _timed(ring, log, key):
    """Record when this replica holds the ring's token (from acquire to release)."""
    acquire, release = ring.acquire, ring.release

    def timed_acquire():
        acquire()
        log.append([(*key, ring.calls, ring.d), time.monotonic(), None])

    def timed_release():
        log[-1][2] = time.monotonic()
        release()

    ring.acquire, ring.release = timed_acquire, timed_release


def _take_turns(sharing):
    """Stage 0 (ranks 0, 1) sends CALLS tensors forward, then stage 1 (ranks 2, 3) CALLS tensors back.
    Replica 0's receivers post late (HOLD s), so replica 1 would go first if it did not wait its turn."""
    plan = two_dc_plan(connections=2, sharing=sharing)
    rings = TemporalSharing(plan) if sharing == "temporal" else None
    wan = WanP2P(open_wan_groups(plan, 2), rings)
    me = dist.get_rank()
    stage, d, _ = plan.coord(me)
    peer = plan.rank(1 - stage, d)
    log = []
    if rings is not None:
        for (_, fwd), ring in rings._rings.items():
            _timed(ring, log, ("fwd" if fwd else "bwd",))
    dist.barrier()
    with recording() as led:
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
            dist.barrier()
    wan.undo()
    tokens = sum(led.calls("send", f"atlas-token(stage{s},tp0,{d})") for s, d in ((0, "fwd"), (1, "bwd")))
    return log, tokens


@pytest.mark.world_size(4, env=LO)
def test_temporal_sharing_takes_turns_in_token_order(world):
    results = world.run(_take_turns, "temporal")
    for direction in ("fwd", "bwd"):
        held = sorted((e for log, _ in results for e in log if e[0][0] == direction and e[2] is not None),
                      key=lambda e: e[1])
        assert [e[0][1:] for e in held] == [(c, d) for c in range(CALLS) for d in range(2)]
        for before, after in pairwise(held):
            assert after[1] >= before[2]             # the link is never held by two replicas at once
    # every send passes the token on; undo() on replica 0 collects the one passed after the last send
    assert [tokens for _, tokens in results] == [CALLS] * 4


@pytest.mark.world_size(4, env=LO)
def test_spatial_sharing_passes_no_token(world):
    assert [tokens for _, tokens in world.run(_take_turns, "spatial")] == [0] * 4
