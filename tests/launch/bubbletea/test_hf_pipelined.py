"""A Hugging Face model pipelined over stages: each stage's cache and the last stage's logits equal the
whole model's chunked prefill bit for bit, for a GPT-2 (learned positions) and a LLaMA (rotary positions)."""

import pytest
import torch

pytest.importorskip("transformers")

from launch.bubbletea.cost import fit_cost
from launch.bubbletea.hf import HFConfig, HFModel, save_tiny
from launch.bubbletea.hf_pipelined import HFStageSpec, split_hf
from launch.bubbletea.pipelined import Rows

V = 97
FAMILIES = ("gpt2", "llama")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """family -> a random 3-layer model of that family, saved and loaded back as an HFConfig."""
    return {family: HFConfig.load(save_tiny(family, tmp_path_factory.mktemp(family), vocab=V, hidden=32,
                                            layers=3, heads=4, max_seq=48, seed=1))
            for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stages, tokens, chunk", [(1, 9, 4), (2, 20, 7), (3, 9, 9)])
def test_stages_in_turn_equal_the_whole_model(configs, family, stages, tokens, chunk):
    cfg = configs[family]
    specs = split_hf(cfg, stages)
    runs = {1: [(0, 3)], 2: [(0, 2), (2, 3)], 3: [(0, 1), (1, 2), (2, 3)]}
    assert [(s.lo, s.hi) for s in specs] == runs[stages]
    models = [s.build() for s in specs]
    caches = [m.new_cache(tokens) for m in models]
    prompt = torch.randint(V, (tokens,), generator=torch.Generator().manual_seed(tokens))
    whole = HFModel(cfg)
    whole_cache = whole.new_cache(tokens)
    for lo in range(0, tokens, chunk):
        x = prompt[lo:lo + chunk]
        expected = whole.prefill_chunk(x, whole_cache)
        for m, c in zip(models, caches, strict=True):
            x = m.prefill_chunk(x, c)
            assert isinstance(x, Rows) != m.last
        assert torch.equal(x, expected)
    for spec, c in zip(specs, caches, strict=True):
        layers = slice(spec.lo, spec.hi)
        assert c.length == tokens
        assert torch.equal(c.k, whole_cache.k[layers]) and torch.equal(c.v, whole_cache.v[layers])


def test_a_later_stage_times_itself_on_rows(configs):
    """The service fits a later stage's cost on rows of the model's width (its ``example_input``)."""
    later = HFStageSpec(configs["llama"], 1, 3).build()
    rows = later.example_input(torch.arange(5))
    assert isinstance(rows, Rows) and rows.x.shape == (5, 32) and rows.real == 5
    a, b, e = fit_cost(later, 16, V, 8, repeats=1)
    assert a > 0 and b >= 0 and e >= 0


def test_bad_splits_are_refused(configs):
    llama = configs["llama"]
    with pytest.raises(ValueError, match=r"layers \[2, 2\) must be a non-empty range inside \[0, 3\)"):
        HFStageSpec(llama, 2, 2)
    with pytest.raises(ValueError, match=r"stages=4 must lie in 1\.\.3"):
        split_hf(llama, 4)
    gemma = HFConfig(llama.path, "float32", "gemma", V, 48, 3, 2, 16)
    with pytest.raises(ValueError, match=r"model_type 'gemma': a Hugging Face model splits into stages for "
                                         r"gpt2, llama only"):
        split_hf(gemma, 2)
