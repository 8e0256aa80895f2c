"""Hugging Face models in BubbleTea: chunked prefill (in the service, in the bubbles) hands a DynamicCache and
the first token to ``generate()``, which continues exactly as ``generate()`` from scratch (greedy), for a
GPT-2 and a LLaMA (GQA) model built here with random weights; nothing is downloaded."""

import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from launch.bubbletea.hf import (  # noqa: E402
    HFConfig,
    HFModel,
    HFPrefillServer,
    cache_argument,
    to_dynamic_cache,
)
from launch.bubbletea.model import KVCache  # noqa: E402
from launch.bubbletea.timeline import Window  # noqa: E402

V, NEW = 101, 8
# initializer_range 0.3: random weights whose greedy continuations vary (the default 0.02 repeats one token)
FAMILIES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, bos_token_id=None,
        eos_token_id=None)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (directory, the model loaded back as a decoder would load it)."""
    out = {}
    for name, make in FAMILIES.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            where = tmp_path_factory.mktemp(name)
            make().save_pretrained(where)
        out[name] = (where, transformers.AutoModelForCausalLM.from_pretrained(where).eval())
    return out


def _prompt(n, seed):
    return torch.randint(V, (n,), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, **kwargs):
    """Greedy; the mask covers every token (left to itself, generate() masks a token equal to the pad id)."""
    return model.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                          do_sample=False, **kwargs)[0]


def _continued(model, prompt, first_token, cache):
    """The decoder's side of the hand-off: the prompt and the first token in, the prompt's cache given."""
    ids = torch.cat([prompt, torch.tensor([first_token])])
    return _generate(model, ids, max_new_tokens=NEW - 1, **{cache_argument(model): cache})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_continues_like_generate_from_scratch(saved, family):
    where, decoder = saved[family]
    cfg = HFConfig.load(where)
    model = HFModel(cfg)
    prompt = _prompt(23, 1)
    scratch = _generate(decoder, prompt, max_new_tokens=NEW)
    assert len(set(scratch[23:].tolist())) > 2            # a continuation worth comparing
    with torch.inference_mode():
        full = transformers.DynamicCache()
        decoder(input_ids=prompt[None], use_cache=True, **{cache_argument(decoder): full})
    for chunk in (1, 5, 23):                               # 5 does not divide 23 (nor the service's 7)
        cache, logits = model.prefill(prompt, chunk)
        assert cache.length == 23 and cache.k.shape == (cfg.layers, cfg.heads, 23, cfg.hidden // cfg.heads)
        # written in place into the KVCache: bit for bit what the library's own DynamicCache holds after
        # the same chunks
        with torch.inference_mode():
            own = transformers.DynamicCache()
            for lo in range(0, 23, chunk):
                out = decoder(input_ids=prompt[None, lo:lo + chunk], use_cache=True,
                              **{cache_argument(decoder): own})
        assert torch.equal(logits, out.logits[0, -1])
        assert all(torch.equal(cache.k[i], layer.keys[0]) and torch.equal(cache.v[i], layer.values[0])
                   for i, layer in enumerate(own.layers))
        for i, layer in enumerate(full.layers):            # float32 rounding only (module docstring)
            torch.testing.assert_close(cache.k[i], layer.keys[0])
            torch.testing.assert_close(cache.v[i], layer.values[0])
        first = int(logits.argmax())
        out = _continued(decoder, prompt, first, to_dynamic_cache(cache))
        print(f"{family} chunk {chunk:2d}: from scratch {scratch[23:].tolist()}, "
              f"from BubbleTea's cache {out[23:].tolist()}")
        assert torch.equal(out, scratch)


@pytest.mark.slow
def test_the_service_prefills_in_windows_and_hands_off(saved):
    """Through the prefill process and the window rule: chunks of 7 into prompts of 23, 7 and 3 tokens (one
    family: a service start imports transformers; GPT-2 takes the same path through HFModel above)."""
    family = "llama"
    where, decoder = saved[family]
    got = []
    server = HFPrefillServer(where, chunk_tokens=7, callback=got.append, cost=(0.001, 0.0, 0.0),
                            nice=0, idle=False)     # a loaded CI machine would starve a SCHED_IDLE service
    try:
        prompts = {f"r{n}": _prompt(n, n) for n in (23, 7, 3)}
        for rid, p in prompts.items():
            server.submit(rid, p)
        server.plan([Window(None, 0.0, 60.0, tag=1)])
        server.open(1, time.perf_counter() + 60.0)
        server.sync()
        server.close()
    finally:
        server.stop()
    assert sorted(r.request for r in got) == sorted(prompts) and server.stats.chunks == 4 + 1 + 1
    for r in got:
        p = prompts[r.request]
        assert isinstance(r.cache, transformers.DynamicCache) and r.cache.get_seq_length() == len(p)
        scratch = _generate(decoder, p, max_new_tokens=NEW)
        assert r.first_token == int(scratch[len(p)])
        out = _continued(decoder, p, r.first_token, r.cache)
        print(f"{family} service, prompt of {len(p):2d}: from scratch {scratch[len(p):].tolist()}, "
              f"from BubbleTea's cache {out[len(p):].tolist()}")
        assert torch.equal(out, scratch)


def test_bad_models_and_settings_are_refused(saved, tmp_path):
    where = saved["llama"][0]
    with pytest.raises(ValueError, match=r"not a directory with a config\.json"):
        HFConfig.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="dtype='int8': must be one of float32, bfloat16"):
        HFConfig.load(where, dtype="int8")
    with pytest.raises(ValueError, match=r"max_seq=65: must be an integer in 1\.\.64"):
        HFConfig.load(where, max_seq=65)
    transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, sliding_window=8)).save_pretrained(tmp_path / "mistral")
    with pytest.raises(ValueError, match="layer 0's cache is a DynamicSlidingWindowLayer, not a full"):
        HFModel(HFConfig.load(tmp_path / "mistral"))
    transformers.T5Config().save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match="model_type 't5' is not a causal LM"):
        HFConfig.load(tmp_path / "t5")
    cfg = HFConfig.load(where, max_seq=16)
    assert (cfg.vocab, cfg.max_seq, cfg.layers, cfg.heads, cfg.hidden) == (V, 16, 2, 2, 16)   # GQA: 2 kv
    model = HFModel(cfg)
    with pytest.raises(ValueError, match="chunk of 17 tokens at position 0: the cache holds 16"):
        model.prefill_chunk(_prompt(17, 0), KVCache.empty(cfg, 16))


def test_the_endpoint_serves_a_dynamic_cache_as_the_kv_cache_it_came_from(saved):
    pytest.importorskip("aiohttp")
    from launch.bubbletea.endpoint import cache_tensors

    model = HFModel(HFConfig.load(saved["llama"][0]))
    cache, _ = model.prefill(_prompt(9, 3), 4)
    k, v = cache_tensors(to_dynamic_cache(cache))
    assert torch.equal(k, cache.k) and torch.equal(v, cache.v) and k.shape == (2, 2, 9, 8)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_save_tiny_builds_a_model_of_causal_lms_size(tmp_path, family):
    """hf.save_tiny (the benchmark's --hf-tiny): 12·D² weights per layer like CausalLM, and it prefills."""
    from launch.bubbletea.hf import save_tiny

    cfg = HFConfig.load(save_tiny(family, tmp_path, hidden=24, layers=2, heads=4, vocab=V, max_seq=32))
    assert (cfg.model_type, cfg.vocab, cfg.max_seq, cfg.layers, cfg.heads, cfg.hidden) == (
        family, V, 32, 2, 4, 24)
    model = HFModel(cfg)
    per_layer = sum(p.numel() for n, p in model.model.named_parameters() if ".0." in n and p.dim() == 2)
    assert per_layer == 12 * 24 * 24          # LLaMA: attention 4·D², gated MLP 3·D·64 with 64 = 8·24/3
    cache, logits = model.prefill(_prompt(9, 2), 4)
    assert cache.length == 9 and logits.shape == (V,)
    with pytest.raises(ValueError, match="family='t5': must be one of gpt2, llama"):
        save_tiny("t5", tmp_path)
