"""A rank's prefill service (a separate SCHED_IDLE process): requests and the hand-off, the cost model, and
the window rule (a planned chunk that would overrun its window is not started)."""

import os
import time

import pytest
import torch

from launch.bubbletea.model import CausalLM, LMConfig
from launch.bubbletea.packer import Chunk
from launch.bubbletea.server import PrefillServer, shared_cores_warning
from launch.bubbletea.timeline import Window

CFG = LMConfig(vocab=50, hidden=32, layers=1, heads=2, max_seq=64, seed=5)
FIRST_CPU = min(os.sched_getaffinity(0))


def _prompt(n, seed=0):
    return torch.randint(50, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def served():
    """One service for the module (a process start imports torch): (server, results list)."""
    got = []
    server = PrefillServer(CFG, chunk_tokens=8, callback=got.append, guard=0.005, cost=(0.05, 0.0, 0.0),
                           cpus=[FIRST_CPU])
    yield server, got
    server.stop()


def test_service_runs_apart_at_the_lowest_priority(served):
    server, _ = served
    assert server._proc.pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, server._proc.pid) == 19
    assert os.sched_getscheduler(server._proc.pid) == os.SCHED_IDLE
    assert os.sched_getaffinity(server._proc.pid) == {FIRST_CPU}
    assert server.cost(Chunk(0, 0, 8, 64)) == pytest.approx(0.05)


def window_rule(server, got):
    """A 16-token prompt (2 chunks of a modelled 50 ms, guard 5 ms) through three windows: too short to
    place, placed but closing early, long enough; also walked by the stream runner (test_device.py)."""
    server.submit("r", _prompt(16))
    server.plan([Window(None, 0.0, 0.03, tag=1)])       # 50 ms + 5 ms guard > 30 ms: nothing placed
    server.open(1, time.perf_counter() + 0.03)
    server.sync()
    assert server.stats.chunks == 0
    server.plan([Window(None, 0.0, 60.0, tag=2)])       # placed, but the window turns out short
    server.open(2, time.perf_counter() + 0.02)
    server.sync()
    assert server.stats.chunks == 0 and server.stats.skipped == 2
    server.plan([Window(None, 0.0, 60.0, tag=3)])
    server.open(3, time.perf_counter() + 60)
    server.sync()
    assert server.stats.chunks == 2 and len(server) == 0 and [r.request for r in got] == ["r"]


def test_a_chunk_that_would_overrun_its_window_is_not_started(served):
    window_rule(*served)


def test_callback_gets_the_models_own_answer(served):
    server, got = served
    got.clear()
    server.submit(7, _prompt(20, 7))
    server.drain()
    (r,) = got
    cache, logits = CausalLM(CFG).prefill(_prompt(20, 7))
    assert torch.equal(r.cache.k, cache.k) and torch.equal(r.cache.v, cache.v) and r.cache.length == 20
    assert torch.equal(r.logits, logits) and r.first_token == int(logits.argmax()) and r.ttft > 0


def test_submit_checks_its_input(served):
    server, _ = served
    server.submit(1, _prompt(4))
    with pytest.raises(ValueError, match="request 1 is already queued"):
        server.submit(1, _prompt(4))
    with pytest.raises(ValueError, match=r"65 tokens; the model takes 1\.\.64"):
        server.submit(2, _prompt(65))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        server.submit(3, torch.tensor([1, 50]))
    server.drain()


def test_the_start_rule_is_switched_in_the_running_service(served):
    """set_tail_quantile checks its value here and hands it to the service, which keeps serving (its effect
    on the rule: test_cost.py)."""
    server, _ = served
    with pytest.raises(ValueError, match=r"tail_quantile=1\.5: must lie in \(0, 1\]"):
        server.set_tail_quantile(1.5)
    server.set_tail_quantile(None)
    server.set_tail_quantile(0.5)
    server.sync()
    assert server.error is None and server._proc.poll() is None


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_tokens": 0}, "chunk_tokens=0: a chunk holds at least one token"),
    ({"guard": -1.0}, "guard=-1.0: the guard band cannot be negative"),
    ({"nice": 25}, r"nice=25: Linux nice values lie in -20\.\.19"),
    ({"cpus": []}, r"cpus=\[\]: must be a non-empty list of CPU numbers among this rank's \[0"),
    ({"cpus": [10_000]}, r"cpus=\[10000\]: must be a non-empty list of CPU numbers"),
    ({"cpus": "0,1"}, r"cpus='0,1': must be a non-empty list of CPU numbers"),
    ({"cpus": [True]}, r"cpus=\[True\]: must be a non-empty list of CPU numbers"),
])
def test_bad_settings_are_refused_before_a_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefillServer(CFG, **{"chunk_tokens": 8, "callback": print, **kwargs})


def test_a_service_free_to_use_other_ranks_cores_is_warned_about():
    assert shared_cores_warning(2, 2, 1) is None                # one rank: every core is its own
    assert shared_cores_warning(1, 2, 2) is None                # bound: one core of two, two ranks
    assert shared_cores_warning(4, 16, 4) is None
    message = shared_cores_warning(2, 2, 4)                     # 4 ranks on 2 cores, unbound
    assert "may run on 2 of this machine's 2 CPUs, which 4 ranks share (1 each)" in message
    assert "--bind_cores_to_rank" in message and "cpus=" in message
    assert "which 2 ranks share (8 each)" in shared_cores_warning(16, 16, 2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU is never more than a rank's share")
def test_an_unbound_rank_among_several_is_warned(monkeypatch):
    """Warned before the service starts; the start itself (a process importing torch, ~3 s, which the
    warning does not need) is cut short at its first step, the window's shared memory."""
    class Started(Exception):
        pass

    def start(name):
        raise Started(name)

    monkeypatch.setenv("LOCAL_SIZE", str(2 * (os.cpu_count() or 1)))      # more ranks than cores
    monkeypatch.setattr(os, "memfd_create", start)
    with pytest.warns(UserWarning, match="Bind cores to ranks"), pytest.raises(Started, match="bubbletea"):
        PrefillServer(CFG, chunk_tokens=8, callback=print, cost=(0.01, 0.0, 0.0))


def test_measured_cost_model_and_a_failing_callback():
    def boom(result):
        raise RuntimeError("decode service down")

    model = CausalLM(CFG)                                # weights travel to the service
    server = PrefillServer(model, chunk_tokens=16, callback=boom, nice=0)
    try:
        small, big = server.cost(Chunk(0, 0, 4, 16)), server.cost(Chunk(0, 0, 16, 64))
        assert 0 < small <= big
        server.submit("r", _prompt(5))
        with pytest.raises(RuntimeError, match="the callback raised RuntimeError"):
            server.drain()
    finally:
        server.stop()
    assert server._proc.returncode == 0
