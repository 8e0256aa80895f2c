"""A rank's prefill service: requests, hand-off, the cost model, and the worker's window rule (a chunk
that would overrun its window is not started)."""

import time

import pytest
import torch

from launch.bubbletea.model import CausalLM, LMConfig
from launch.bubbletea.packer import Chunk
from launch.bubbletea.server import PrefillServer, Worker
from launch.bubbletea.timeline import Window


@pytest.fixture(scope="module")
def model():
    return CausalLM(LMConfig(vocab=50, hidden=32, layers=1, heads=2, max_seq=64, seed=5))


def _prompt(n, seed=0):
    return torch.randint(50, (n,), generator=torch.Generator().manual_seed(seed))


def test_chunks_in_order_then_the_callback_gets_the_models_own_answer(model):
    got = []
    server = PrefillServer(model, chunk_tokens=8, callback=got.append)
    server.submit("r", _prompt(20))
    assert not server.run_chunk(Chunk("r", 8, 16, 20))          # not its next chunk: refused, nothing done
    for lo in (0, 8, 16):
        assert server.run_chunk(Chunk("r", lo, min(lo + 8, 20), 20))
    assert len(server) == 0 and len(got) == 1
    cache, logits = model.prefill(_prompt(20))
    assert torch.equal(got[0].cache.k, cache.k) and torch.equal(got[0].cache.v, cache.v)
    assert torch.equal(got[0].logits, logits) and got[0].first_token == int(logits.argmax())
    assert got[0].ttft > 0 and server.stats.chunks == 3 and server.stats.tokens == 20


def test_submit_checks_its_input(model):
    server = PrefillServer(model, 8, callback=print)
    server.submit(1, _prompt(4))
    with pytest.raises(ValueError, match="request 1 is already queued"):
        server.submit(1, _prompt(4))
    with pytest.raises(ValueError, match=r"65 tokens; the model takes 1\.\.64"):
        server.submit(2, _prompt(65))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        server.submit(3, torch.tensor([1, 50]))
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        PrefillServer(model, 0, callback=print)


def test_cost_model_grows_with_chunk_and_cache(model):
    server = PrefillServer(model, 16, callback=print)
    server.calibrate(repeats=1)
    small, big = server.cost(Chunk(0, 0, 4, 16)), server.cost(Chunk(0, 0, 16, 64))
    assert 0 < small <= big


def test_plan_packs_the_queue_into_the_windows(model):
    server = PrefillServer(model, 8, callback=print, guard=0.001)
    server._fit = (0.01, 0.0, 0.0)            # 10 ms per chunk, whatever its size
    for i in range(3):
        server.submit(i, _prompt(16, i))      # two chunks each
    packing = server.plan([Window(0, 0.0, 0.035, tag=7), Window(0, 0.1, 0.2, tag=9)])
    by_tag = {w.tag: [(p.chunk.request, p.chunk.lo) for p in ps] for w, ps in packing.by_window().items()}
    assert by_tag == {7: [(0, 0), (0, 8), (1, 0)], 9: [(1, 8), (2, 0), (2, 8)]}


def test_worker_starts_only_chunks_that_end_a_guard_before_the_deadline(model):
    server = PrefillServer(model, 8, callback=print, guard=0.005)
    server._fit = (0.05, 0.0, 0.0)            # predicted 50 ms per chunk
    server.submit("r", _prompt(16))
    worker = Worker(server, nice=0)
    try:
        worker.open([Chunk("r", 0, 8, 16), Chunk("r", 8, 16, 16)], time.perf_counter() + 0.03)
        assert worker.idle(10)
        assert server.stats.chunks == 0 and server.stats.skipped == 2     # 50 ms + 5 ms > 30 ms: not started
        worker.open([Chunk("r", 0, 8, 16), Chunk("r", 8, 16, 16)], time.perf_counter() + 60)
        assert worker.idle(30)
        assert server.stats.chunks == 2 and len(server) == 0
    finally:
        worker.stop()


def test_worker_surfaces_a_failure(model):
    def boom(result):
        raise RuntimeError("decode service down")

    server = PrefillServer(model, 8, callback=boom)
    server._fit = (1e-6, 0.0, 0.0)
    server.submit("r", _prompt(4))
    worker = Worker(server, nice=0)
    try:
        worker.open([Chunk("r", 0, 4, 4)], time.perf_counter() + 60)
        assert worker.idle(30)
        assert isinstance(worker.error, RuntimeError)
    finally:
        worker.stop()
