"""The inference model: chunked prefill with a KV cache is bit-equal to one full forward, and close to an
independent dense causal forward; it never touches the global RNG."""

import pytest
import torch

from launch.bubbletea.model import MIN_ROWS, CausalLM, KVCache, LMConfig, chunk_exact, reference_logits


@pytest.fixture(scope="module")
def model():
    return CausalLM(LMConfig(vocab=97, hidden=64, layers=2, heads=4, max_seq=160, seed=3))


def _prompt(n, vocab=97, seed=0):
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tokens, chunk", [(1, 1), (5, 1), (5, 3), (MIN_ROWS, 3), (MIN_ROWS, 16), (41, 1),
                                           (41, 7), (41, 16), (41, 40), (160, 16), (160, 64), (160, 150)])
def test_chunked_prefill_is_bit_equal_to_one_forward(model, tokens, chunk):
    prompt = _prompt(tokens, seed=tokens)
    full_cache, full = model.prefill(prompt)
    cache, last = model.prefill(prompt, chunk)
    assert cache.length == full_cache.length == tokens
    assert torch.equal(cache.k, full_cache.k) and torch.equal(cache.v, full_cache.v)
    assert torch.equal(last, full)


def test_cached_path_matches_a_dense_causal_forward(model):
    prompt = _prompt(100, seed=9)
    ref = reference_logits(model, prompt)
    _, last = model.prefill(prompt, 24)
    torch.testing.assert_close(last, ref[-1], rtol=1e-5, atol=1e-5)
    # every chunk's logits, not just the last token's
    cache = KVCache.empty(model.cfg, 100)
    rows = torch.cat([model.prefill_chunk(prompt[lo:lo + 24], cache) for lo in range(0, 100, 24)])
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)


def test_weights_and_prefill_leave_the_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    m = CausalLM(LMConfig(hidden=32, heads=2, max_seq=32))
    m.prefill(_prompt(20, 512), 7)
    assert torch.equal(torch.get_rng_state(), state)
    assert chunk_exact(m, tokens=30, chunk=7)
    assert not any(p.requires_grad for p in m.parameters())


def test_same_seed_same_weights_different_seed_different():
    a, b = CausalLM(LMConfig(hidden=32, heads=2, seed=1)), CausalLM(LMConfig(hidden=32, heads=2, seed=1))
    c = CausalLM(LMConfig(hidden=32, heads=2, seed=2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.head.weight, c.head.weight)
    assert LMConfig().params == sum(p.numel() for p in CausalLM(LMConfig()).parameters())


@pytest.mark.parametrize("kwargs, message", [
    ({"hidden": 30, "heads": 4}, "hidden=30 must be a multiple of heads=4"),
    ({"layers": 0}, "LMConfig.layers must be a positive integer"),
    ({"vocab": True}, "LMConfig.vocab must be a positive integer"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LMConfig(**kwargs)


def test_overlong_prompts_and_chunks_are_refused(model):
    with pytest.raises(ValueError, match=r"prompt of 161 tokens: the model takes 1\.\.160"):
        KVCache.empty(model.cfg, 161)
    cache = KVCache.empty(model.cfg, 10)
    model.prefill_chunk(_prompt(8), cache)
    with pytest.raises(ValueError, match="chunk of 3 tokens at position 8: the cache holds 10"):
        model.prefill_chunk(_prompt(3), cache)
