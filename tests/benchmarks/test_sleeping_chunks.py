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
    t0, early = time.perf_counter(), model.overshoot   # less the sleeps' running overshoot
    model.prefill_chunk(torch.arange(8), cache)
    assert 0.0 <= early < 0.01 and time.perf_counter() - t0 >= 0.05 - early and cache.length == 16
    assert torch.equal(cache.k, torch.zeros_like(cache.k))         # nothing computed into the cache


def test_pipelined_sleeping_stages_still_send_rows_of_the_real_shape():
    """--pipelined --sleeping-chunks: two stage services over a real loopback link. Stage 0 sleeps its
    chunks but sends, at the end of the window, one message with every chunk's rows in the shape, dtype
    and bytes the computing stage sends (the oracle: the real stage run on the same chunks), all zeros;
    stage 1 runs on them and reports the request finished back up the link."""
    import torch

    from benchmarks.bubbletea_rank import rank_spec
    from launch.bubbletea.pipelined import Rows
    from tests.launch.bubbletea.stage_pair import StagePair

    cfg = {"hf": None, "lm_hidden": 32, "lm_layers": 2, "prompt": 40, "pipelined": True,
           "sleeping_chunks": True}
    specs = [rank_spec(cfg, j, 2) for j in range(2)]
    assert all(isinstance(s, SleepingChunks) for s in specs)
    pair = StagePair(specs, 16, b"s" * 16)
    prompt = torch.randint(specs[0].vocab, (40,), generator=torch.Generator().manual_seed(3))
    pair.services[0].handle(("submit", "p", prompt, 0.0))
    pair.window(0, 1)
    rows = pair.take(1, 1)        # stage 0's three chunks (16, 16, 8 tokens) crossed in one message
    computing = specs[0].spec.build()
    cache = computing.new_cache(40)
    oracle = [computing.prefill_chunk(prompt[lo:lo + 16], cache) for lo in (0, 16, 32)]
    assert [(m[0], [part[:4] for part in m[1]]) for m in rows] == [
        ("rows", [("p", 0, 16, 40), ("p", 16, 32, 40), ("p", 32, 40, 40)])]
    sent = [part[4] for part in rows[0][1]]
    assert all(isinstance(r, Rows) for r in sent)
    assert [(r.x.shape, r.x.dtype, r.real) for r in sent] == [(o.x.shape, o.x.dtype, o.real) for o in oracle]
    assert sum(r.x.nbytes for r in sent) == sum(o.x.nbytes for o in oracle) == 3 * 16 * 32 * 4
    assert all(not r.x.any() for r in sent)                  # zeros: nothing was computed
    pair.window(1, 1, rows)
    assert [m[0] for m in pair.outs[1]].count("chunk") == 3 and pair.done(1) == ["p"]
    assert pair.take(0, 1) == [("finished", "p")]
    pair.close()
