"""benchmarks/sleeping_chunks.py: a chunk of a timed shape sleeps that time and leaves the cache empty."""

from benchmarks.sleeping_chunks import SleepingChunks


def test_sleeping_chunks_keep_the_cache_and_the_messages_without_the_work():
    import time

    import torch

    from launch.bubbletea import LMConfig

    spec = SleepingChunks(LMConfig(vocab=40, hidden=16, layers=1, heads=2, max_seq=16))
    assert (spec.vocab, spec.max_seq) == (40, 16)
    model = spec.build(torch.device("cpu"))
    cache = model.new_cache(16)
    logits = model.prefill_chunk(torch.arange(8), cache)
    assert cache.length == 8 and torch.equal(logits, torch.zeros(8, 40)) and list(model.seconds) == [(8, 0)]
    model.seconds[(8, 8)] = 0.05                   # a shape timed before: slept, not run
    t0 = time.perf_counter()
    model.prefill_chunk(torch.arange(8), cache)
    assert time.perf_counter() - t0 >= 0.05 and cache.length == 16
    assert torch.equal(cache.k, torch.zeros_like(cache.k))         # nothing computed into the cache
