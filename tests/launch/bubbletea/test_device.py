"""The device runner (a thread of the rank on the device's low-priority stream) walked on a CPU with the
null stream: the window rule, the hand-off, the memory cap and the model interface other models plug into."""

import time

import pytest
import torch

from launch.bubbletea import device as dev
from launch.bubbletea.model import CausalLM, KVCache, ModelSpec, PrefillModel
from launch.bubbletea.server import PrefillServer
from launch.bubbletea.timeline import Window
from tests.launch.bubbletea.test_server import CFG, _prompt, window_rule

CACHE_BYTES_PER_TOKEN = 2 * 1 * 32 * 4          # k and v, L = 1 layer, H·Dh = 32, fp32


@pytest.fixture(scope="module")
def served():
    got = []
    server = PrefillServer(CFG, chunk_tokens=8, callback=got.append, guard=0.005, cost=(0.05, 0.0, 0.0),
                           runner="stream", memory_fraction=None)
    yield server, got
    server.stop()


def test_the_cpu_stream_is_the_null_stream_and_the_runner_a_thread_of_this_process(served):
    server, _ = served
    assert server._proc is None and server._runner.alive() and server._runner.stream is None
    cpu = torch.device("cpu")
    assert dev.prefill_stream(cpu) is None and dev.training_stream(cpu) is None
    with dev.on_stream(None):
        dev.synchronize(None)


def test_the_window_rule_on_the_stream_runner(served):
    server, got = served
    window_rule(server, got)
    (r,) = got
    cache, logits = CausalLM(CFG).prefill(_prompt(16), 8)
    assert isinstance(r.cache, KVCache) and torch.equal(r.cache.k, cache.k) and torch.equal(r.logits, logits)
    c = server.counters()
    assert (c["chunks"], c["tokens"], c["prompts"], c["queue"], c["queue_peak"]) == (2, 16, 1, 0, 1)


def test_the_memory_cap_admits_caches_in_order():
    got = []
    server = PrefillServer(CFG, chunk_tokens=64, callback=got.append, cost=(1e-3, 0.0, 0.0), runner="stream",
                           memory_fraction=0.5)
    try:
        measured = server.measure_memory()
        assert 0 < measured["cap"] <= measured["free"] // 2 + 1 and measured["weights"] > 0
        server.local_ranks = 4                       # a host's 4 ranks share its memory: an eighth each
        measured = server.measure_memory()
        assert 0 < measured["cap"] <= measured["free"] // 8 + 1
        with pytest.raises(ValueError, match="sharers=0: must be a positive integer"):
            dev.memory_cap(torch.device("cpu"), 0.5, 0)
        server._post("cap", 40 * CACHE_BYTES_PER_TOKEN)      # room for one 40-token cache at a time
        server.sync()
        for i, n in enumerate((40, 30, 10)):
            server.submit(i, _prompt(n, i))
        server.plan([Window(None, 0.0, 60.0, tag=0)])
        server.open(0, time.perf_counter() + 60)
        server.sync()
        # the first fits; the second (30 tokens) waits for the first to be handed off, and the third
        # does not overtake it although it would fit
        assert [r.request for r in got] == [0]
        assert server.memory["kv_peak"] == 40 * CACHE_BYTES_PER_TOKEN and server.memory["kv"] == 0
        server.plan([Window(None, 0.0, 60.0, tag=1)])
        server.open(1, time.perf_counter() + 60)
        server.sync()
        assert [r.request for r in got] == [0, 1, 2]
        assert server.memory["kv_peak"] == 40 * CACHE_BYTES_PER_TOKEN
    finally:
        server.stop()


class _Doubled:
    """Another model behind the interface: a spec (picklable, vocab, max_seq, build) and a model whose
    cache is its own class (here: a CausalLM's cache in a wrapper)."""

    vocab, max_seq = CFG.vocab, CFG.max_seq

    def build(self, device):
        return _DoubledModel(CFG.build(device))


class _Cache:
    def __init__(self, inner):
        self.inner = inner

    length = property(lambda self: self.inner.length)
    nbytes = property(lambda self: self.inner.nbytes)


class _DoubledModel:
    def __init__(self, lm):
        self.lm = lm

    def new_cache(self, tokens):
        return _Cache(self.lm.new_cache(tokens))

    def prefill_chunk(self, tokens, cache):
        return 2 * self.lm.prefill_chunk(tokens, cache.inner)


class _Slow(_Doubled):
    """A model whose chunks take 30 ms whatever the cost model says."""

    def build(self, device):
        return _SlowModel(CFG.build(device))


class _SlowModel(_DoubledModel):
    def prefill_chunk(self, tokens, cache):
        time.sleep(0.03)
        return super().prefill_chunk(tokens, cache)


def test_a_chunk_that_outlasts_its_window_is_counted_late():
    """Predicted 1 ms, it runs 30 ms in a 20 ms window: one late chunk, ~10 ms past the window's end,
    measured / predicted ~30; the chunk after it, predicted from the corrected ratio, is not started."""
    server = PrefillServer(_Slow(), chunk_tokens=8, callback=lambda r: None, guard=0.0, cost=(1e-3, 0.0, 0.0),
                           runner="stream", memory_fraction=None)
    try:
        server.submit("x", _prompt(16, 1))
        server.plan([Window(None, 0.0, 60.0, tag=0)])
        server.open(0, time.perf_counter() + 0.02)
        server.sync()
    finally:
        server.stop()
    c = server.counters()
    assert (c["chunks"], c["late"], c["skipped"]) == (1, 1, 1)
    assert 0.009 < c["late_s"] < 1.0 and c["cost_ratio_median"] == c["cost_ratio_p90"] > 25


@pytest.mark.parametrize("runner", ["stream", "process"])
def test_any_model_behind_the_interface(runner):
    assert isinstance(_Doubled(), ModelSpec) and isinstance(_Doubled().build("cpu"), PrefillModel)
    got = []
    server = PrefillServer(_Doubled(), chunk_tokens=8, callback=got.append, cost=(1e-3, 0.0, 0.0),
                           runner=runner, nice=0, idle=False)
    try:
        server.submit("x", _prompt(20, 3))
        server.drain()
    finally:
        server.stop()
    (r,) = got
    cache, logits = CausalLM(CFG).prefill(_prompt(20, 3), 8)
    assert isinstance(r.cache, _Cache) and torch.equal(r.cache.inner.k, cache.k)
    assert torch.equal(r.logits, 2 * logits) and r.first_token == int(logits.argmax())


@pytest.mark.parametrize("kwargs, message", [
    ({"runner": "gpu"}, "runner='gpu': 'stream' \\(any device\\) or 'process'"),
    ({"memory_fraction": 0.0}, r"memory_fraction=0.0: must lie in \(0, 1\]"),
    ({"memory_fraction": 1.5}, r"memory_fraction=1.5: must lie in \(0, 1\]"),
    ({"device": "nodevice"}, "device='nodevice': not a device"),
])
def test_bad_device_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefillServer(CFG, chunk_tokens=8, callback=print, **kwargs)
    with pytest.raises(ValueError, match="config=int: an LMConfig, a CausalLM or a ModelSpec"):
        PrefillServer(3, chunk_tokens=8, callback=print)
