"""Temporal WAN sharing: the replicas of a stage hold the link one at a time, in (micro-batch,
replica) order, in both directions; spatial sharing (the stock behaviour) passes no token. A stage
with WAN links on both sides runs Megatron's 1F1B order over three data centers with message tags
switched off (NCCL's matching), dp = 3: each ring keeps its own tokens."""

import time
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from commweave.ledger import recording
from launch.net.sharing import TemporalSharing
from launch.net.striping import open_wan_groups
from launch.net.wan_p2p import WanP2P
from tests.launch.plans import three_dc_plan, two_dc_plan

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


def _code(stage: int, replica: int, micro: int, forward: bool) -> float:
    return float(1000 * stage + 100 * replica + 2 * micro + (0 if forward else 1))


def _one_f_one_b(plan, wan, micro: int, steps: int) -> int:
    """Megatron's non-interleaved 1F1B order of pipeline transfers on this rank (warm-up forwards,
    send_forward_recv_backward / send_backward_recv_forward in the steady state, cool-down backwards),
    each combined call posted receives-first as WanP2P does; every received value is checked."""
    me = dist.get_rank()
    s, d, _ = plan.coord(me)
    last = plan.pp - 1
    prev, nxt = (plan.rank(s - 1, d) if s > 0 else None), (plan.rank(s + 1, d) if s < last else None)
    checked = 0

    def exchange(send_f=None, send_b=None, recv_f=None, recv_b=None):
        nonlocal checked
        ops = {}
        for name, m, peer in (("recv_prev", recv_f, prev), ("recv_next", recv_b, nxt)):
            if m is not None and peer is not None:
                ops[name] = (torch.empty(64), peer)
        for name, m, peer, forward in (("send_next", send_f, nxt, True), ("send_prev", send_b, prev, False)):
            if m is not None and peer is not None:
                ops[name] = (torch.full((64,), _code(s, d, m, forward)), peer)
        for req in wan._post(ops).values():
            req.wait()
        received = (("recv_prev", recv_f, s - 1, True), ("recv_next", recv_b, s + 1, False))
        for name, m, stage, forward in received:
            if name in ops:
                assert torch.equal(ops[name][0], torch.full((64,), _code(stage, d, m, forward))), (name, m)
                checked += 1

    for _ in range(steps):
        warm = min(last - s, micro)
        for i in range(warm):
            exchange(recv_f=i)
            exchange(send_f=i)
        if micro > warm:
            exchange(recv_f=warm)
        for i in range(micro - warm):
            exchange(send_f=i + warm, recv_b=i)
            exchange(send_b=i, recv_f=i + warm + 1 if i < micro - warm - 1 else None)
        for i in range(micro - warm, micro):
            exchange(recv_b=i)
            exchange(send_b=i)
    return checked


def _three_dc_without_tags(micro, steps):
    """Stage 1 (DC b) sends forward to c and backward to a, each over the WAN, taking turns with its two
    other replicas on two token rings; every tag is forced to 0, as NCCL ignores tags."""
    plan = three_dc_plan(dp=3)
    isend, irecv = comm.isend, comm.irecv
    comm.isend = lambda tensor, peer, group, tag=0: isend(tensor, peer, group, 0)
    comm.irecv = lambda tensor, peer, group, tag=0: irecv(tensor, peer, group, 0)
    try:
        rings = TemporalSharing(plan)
        wan = WanP2P(open_wan_groups(plan, 1), rings, plan=plan)     # one stripe: a whole NCCL transfer
        log = []
        for (_, fwd), ring in rings._rings.items():
            _timed(ring, log, ("fwd" if fwd else "bwd", plan.coord(dist.get_rank())[0]))
        checked = _one_f_one_b(plan, wan, micro, steps)
        wan.undo()
        wan.undo()                                  # a second undo posts nothing (no receive left hanging)
        dist.barrier()
    finally:
        comm.isend, comm.irecv = isend, irecv
    return log, checked


@pytest.mark.slow
@pytest.mark.world_size(9, env=LO)
def test_three_dc_stage_with_wan_on_both_sides_without_tags(world):
    micro, steps = 4, 2
    results = world.run(_three_dc_without_tags, micro, steps)
    held = [e for log, _ in results for e in log if e[2] is not None]   # close() only collects a token
    # stage 0 sends forward only, stage 2 backward only, stage 1 both: four rings of three replicas
    assert sorted({e[0][:2] for e in held}) == [("bwd", 1), ("bwd", 2), ("fwd", 0), ("fwd", 1)]
    for ring in {e[0][:2] for e in held}:
        turns = sorted((e for e in held if e[0][:2] == ring), key=lambda e: e[1])
        assert [e[0][2:] for e in turns] == [(c, d) for c in range(micro * steps) for d in range(3)]
        for before, after in pairwise(turns):
            assert after[1] >= before[2]             # one replica on the link at a time
    # every received activation and gradient was the one sent (stage 1 receives both ways)
    assert [checked for _, checked in results] == [micro * steps * n for n in (1, 1, 1, 2, 2, 2, 1, 1, 1)]
