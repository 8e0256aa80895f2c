"""The multi-rank harness itself: results, propagated errors, dead ranks, timeouts, restart."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from commweave.world import RankError, World, WorldTimeout


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    # The healthy ranks block in a collective the failed rank never joins: the harness must not wait
    # for the per-call timeout to end the test.
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def _die_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _sleep_on(bad_rank, seconds):
    if dist.get_rank() == bad_rank:
        time.sleep(seconds)
    return dist.get_rank()


@pytest.mark.world_size(3)
def test_results_in_rank_order(world):
    assert world.run(_rank_and_sum) == [(0, 3.0), (1, 3.0), (2, 3.0)]


@pytest.mark.world_size(3)
def test_exception_carries_rank_and_traceback_and_world_restarts(world):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        world.run(_raise_on, 1)
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert "rank 1" in text and "deliberate failure on rank 1" in text and "Traceback" in text
    assert not world.alive
    assert world.run(_rank_and_sum)[2] == (2, 3.0)


@pytest.mark.world_size(3)
def test_dead_rank_is_reported_not_waited_for(world):
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 2 died \(exit code 3\)"):
        world.run(_die_on, 2)
    assert time.monotonic() - t0 < 30


def test_timeout_kills_the_world():
    with World(2, timeout=60) as w:
        t0 = time.monotonic()
        with pytest.raises(WorldTimeout, match=r"ranks \[0\] of 2 did not finish within 2 s"):
            w.run(_sleep_on, 0, 3600, timeout=2)
        assert time.monotonic() - t0 < 15
        assert not w.alive
        assert w.run(_sleep_on, 0, 0) == [0, 1]


def test_world_size_and_timeouts_validated():
    with pytest.raises(ValueError, match=r"world_size=0: must be an integer in \[1, 4096\]"):
        World(0)
    for bad in (0.0005, 0, -1, 1e14, float("nan"), True):
        with pytest.raises(ValueError, match=r"World.timeout=.*: the timeout must be a finite number of "
                                             r"seconds in \[1, 604800\]"):
            World(2, timeout=bad)
        with pytest.raises(ValueError, match=r"World.start_timeout="):
            World(2, start_timeout=bad)
    with pytest.raises(ValueError, match=r"World.run\(timeout\)=0.0001: "):
        World(1).run(print, timeout=1e-4)
    with pytest.raises(ValueError, match=r"World\(env\): DS_ACCELERATOR='cuda' with preload=\['torch'\]"):
        World(2, env={"DS_ACCELERATOR": "cuda"}, preload=("torch",))
