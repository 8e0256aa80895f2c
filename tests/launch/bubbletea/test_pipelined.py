"""The inference model pipelined over stages: each stage's layers and cache, and the last stage's logits,
equal the whole model's bit for bit — stage by stage in one process, through linked services, and on
2 CPU ranks prefilling in the bubbles of a DeepSpeed pipeline whose training stays bit-identical."""

import threading
import time

import pytest
import torch

from launch.bubbletea.model import CausalLM, LMConfig
from launch.bubbletea.pipelined import Rows, StageSpec, pipeline_setup, split
from launch.bubbletea.server import PrefillServer
from launch.bubbletea.timeline import Window

CFG = LMConfig(vocab=64, hidden=32, layers=3, heads=2, max_seq=48, seed=11)


def _prompt(n, seed=0):
    return torch.randint(CFG.vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("stages, tokens, chunk", [(2, 40, 16), (3, 5, 3), (3, 48, 48), (1, 20, 7)])
def test_stages_in_turn_equal_the_whole_model(stages, tokens, chunk):
    specs = split(CFG, stages)
    assert specs[0].lo == 0 and specs[-1].hi == CFG.layers
    models = [s.build() for s in specs]
    caches = [m.new_cache(tokens) for m in models]
    prompt = _prompt(tokens, tokens)
    for lo in range(0, tokens, chunk):
        x = prompt[lo:lo + chunk]
        for m, c in zip(models, caches, strict=True):
            x = m.prefill_chunk(x, c)
            assert isinstance(x, Rows) != m.last
    whole_cache, whole = CausalLM(CFG).prefill(prompt, chunk)
    assert torch.equal(x[-1], whole)
    for spec, c in zip(specs, caches, strict=True):
        layers = slice(spec.lo, spec.hi)
        assert torch.equal(c.k, whole_cache.k[layers]) and torch.equal(c.v, whole_cache.v[layers])


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match=r"layers \[2, 2\) must be a non-empty range inside \[0, 3\)"):
        StageSpec(CFG, 2, 2)
    with pytest.raises(ValueError, match=r"stages=4 must lie in 1\.\.3"):
        split(CFG, 4)


@pytest.mark.slow
def test_linked_services_prefill_window_by_window():
    """Two stage services (processes at SCHED_IDLE, as on CPU ranks) linked over loopback: stage 0 runs a
    chunk in its window and sends the rows; stage 1 runs them in its own next window."""
    specs, got = split(CFG, 2), [[], []]
    servers = [PrefillServer(spec, 16, callback=got[j].append, cost=(1e-3, 0.0, 0.0), nice=0, idle=False,
                             pipeline=pipeline_setup(j, 2, "127.0.0.1", b"k" * 16))
               for j, spec in enumerate(specs)]
    try:
        accept = threading.Thread(target=servers[1].link, args=("accept",))
        accept.start()
        servers[0].link(servers[1].address)
        accept.join()
        servers[0].submit("p", _prompt(40, 1))
        for tag in range(4):                       # alternate windows: stage 0, then stage 1
            for s in servers:
                s.plan([Window(None, 0.0, 60.0, tag)])
                s.open(tag, time.perf_counter() + 60.0)
                s.sync()
                s.close()
            time.sleep(0.05)
        for _ in range(100):
            servers[1].sync()
            if got[1]:
                break
            time.sleep(0.05)
    finally:
        for s in servers:
            s.stop()
    cache, logits = CausalLM(CFG).prefill(_prompt(40, 1), 16)
    (first,), (last,) = got
    assert first.logits is None and first.first_token is None
    assert torch.equal(first.cache.k, cache.k[:2]) and torch.equal(last.cache.k, cache.k[2:])
    assert torch.equal(last.logits, logits) and last.first_token == int(logits.argmax())
    assert servers[0].stats.chunks == servers[1].stats.chunks == 3
    # stage 1's queue counted the request its rows brought, until its part was done
    assert [(s.counters()["queue"], s.counters()["queue_peak"]) for s in servers] == [(0, 1), (0, 1)]


HIDDEN, LAYERS, MICRO, BATCH, STEPS, WAN_S = 32, 2, 4, 4, 6, 0.01
PROMPTS = 2


def _train(pipelined: bool) -> dict:
    import torch.distributed as dist

    from examples.bubbletea_pipeline import build_engine, data, emulate_wan_latency
    from launch.bubbletea.engine import enable
    from launch.bubbletea.pipelined import link_stages, shared_key

    torch.manual_seed(0)
    engine = build_engine(HIDDEN, LAYERS, MICRO, BATCH)
    wan = emulate_wan_latency(WAN_S)
    world, stage, got, bt = dist.group.WORLD, dist.get_rank(), [], None
    if pipelined:
        # stage j of the inference model on stage j of the training pipeline (2 ranks: one data center)
        setup = pipeline_setup(stage, 2, "127.0.0.1", shared_key(world))
        server = PrefillServer(split(CFG, 2)[stage], chunk_tokens=16, callback=got.append, guard=5e-4,
                               nice=0, idle=False, cost=(5e-4, 0.0, 0.0), pipeline=setup)
        link_stages(server, world)
        if stage == 0:
            for i in range(PROMPTS):
                server.submit(i, _prompt(40, i))
        bt = enable(engine, server, warmup=2)
    try:
        losses = [float(engine.train_batch(data(engine, s, BATCH, HIDDEN))) for s in range(STEPS)]
        out = {"losses": losses, "rng": torch.get_rng_state()}
        if bt is not None:
            bt.wait_idle()
            in_windows = server.stats.chunks
            dist.barrier()
            if stage == 0:
                server.drain()                # what the windows left: stage 1 drains after its rows
            deadline = time.monotonic() + 120
            while len(got) < PROMPTS and time.monotonic() < deadline:
                server.sync()
                time.sleep(0.05)
            dist.barrier()
            whole = CausalLM(CFG)
            spec = split(CFG, 2)[stage]
            checks = []
            for r in sorted(got, key=lambda r: r.request):
                cache, logits = whole.prefill(_prompt(40, r.request), 16)
                ok = torch.equal(r.cache.k, cache.k[spec.lo:spec.hi]) and torch.equal(r.cache.v,
                                                                                     cache.v[spec.lo:spec.hi])
                if stage == 1:
                    ok = ok and torch.equal(r.logits, logits) and r.first_token == int(logits.argmax())
                checks.append(ok)
            out.update(checks=checks, in_windows=in_windows)
            bt.undo()
            server.stop()
        return out
    finally:
        wan.undo()


def _case():
    return _train(False), _train(True)


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_pipelined_prefill_in_the_bubbles_is_exact_and_leaves_training_bit_equal(world):
    results = world.run(_case)
    for without, with_bt in results:
        assert with_bt["losses"] == without["losses"] and torch.equal(with_bt["rng"], without["rng"])
        assert with_bt["checks"] == [True] * PROMPTS
    assert all(b["in_windows"] >= 1 for _, b in results)       # both stages prefilled inside training


def test_a_stage_admits_no_new_request_while_the_next_is_behind():
    """Two stage services in this process over a real link, ``ahead`` 1: stage 0 starts one of its two
    queued requests and holds the other back until stage 1 reports the first finished."""
    from tests.launch.bubbletea.stage_pair import StagePair

    key = b"b" * 16
    pair = StagePair(split(CFG, 2), 8, key, ahead=1)
    for rid in ("a", "b"):
        pair.services[0].handle(("submit", rid, _prompt(8, len(rid)), 0.0))
    pair.window(0, 1)
    assert pair.done(0) == ["a"] and pair.services[0].ahead == {"a"}        # "b" held back: "a" in flight
    pair.window(0, 2, pair.take(0))
    assert pair.done(0) == ["a"]
    pair.window(1, 1, pair.take(1, 1))         # a message over the loopback link: "a"'s rows
    assert pair.done(1) == ["a"]
    pair.window(0, 3, pair.take(0, 1))         # ... and "finished" coming back
    assert pair.done(0) == ["a", "b"] and pair.services[0].ahead == {"b"}
    pair.close()
    with pytest.raises(ValueError, match="ahead=0: a stage must be allowed one request or more"):
        pipeline_setup(0, 2, "127.0.0.1", key, ahead=0)


def test_a_window_hands_on_its_rows_and_its_finished_requests_in_one_message():
    """Per window, not per chunk: stage 0's window of two requests (three chunks) crosses as one rows
    message, and stage 1's window that finishes both answers with one "finished" naming both; stage 1's
    caches equal the whole model's."""
    from tests.launch.bubbletea.stage_pair import StagePair

    pair = StagePair(split(CFG, 2), 8, b"w" * 16)
    prompts = {"a": _prompt(16, 1), "b": _prompt(5, 2)}
    for rid, tokens in prompts.items():
        pair.services[0].handle(("submit", rid, tokens, 0.0))
    pair.window(0, 1)
    rows = pair.take(1, 1)
    assert [(m[0], [part[:3] for part in m[1]]) for m in rows] == [
        ("rows", [("a", 0, 8), ("a", 8, 16), ("b", 0, 5)])]
    time.sleep(0.05)
    assert pair.take(1) == []                                    # nothing else crossed
    pair.window(1, 1, rows)
    assert pair.done(1) == ["a", "b"]
    finished = pair.take(0, 1)
    assert finished == [("finished", "a", "b")]
    pair.window(0, 2, finished)
    assert pair.services[0].ahead == set()
    whole = CausalLM(CFG)
    caches = {m[1]: m[2] for m in pair.outs[1] if m[0] == "done"}
    for rid, tokens in prompts.items():
        cache, _ = whole.prefill(tokens, 8)
        assert torch.equal(caches[rid].k, cache.k[2:]) and torch.equal(caches[rid].v, cache.v[2:])
    pair.close()
