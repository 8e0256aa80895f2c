"""benchmarks.bubbletea, the command line: the cores each rank is bound to, the Hugging Face model it saves
for the ranks (--hf-tiny), and the options it refuses."""

from pathlib import Path

import pytest

from benchmarks import bubbletea as bench
from benchmarks.bubbletea_rank import prefill_spec


def test_core_shares_split_like_bind_cores_to_rank():
    assert bench.core_shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert bench.core_shares([4, 6], 2) == [[4], [6]]
    with pytest.raises(ValueError, match="4 ranks cannot each have a core of 2"):
        bench.core_shares([0, 1], 4)


def test_a_hugging_face_model_is_the_spec_every_rank_prefills(tmp_path):
    """--hf-tiny saves a random model of CausalLM's size, the ranks prefill its HFConfig; removed after."""
    pytest.importorskip("transformers")
    from launch.bubbletea import LMConfig
    from launch.bubbletea.hf import HFConfig

    cfg = {"hf": None, "hf_tiny": "llama", "lm_hidden": 64, "lm_layers": 2, "prompt": 48}
    assert prefill_spec(cfg) == LMConfig(hidden=64, layers=2, max_seq=48)
    with bench.hf_model(cfg) as tiny:
        spec = prefill_spec(tiny)
        assert isinstance(spec, HFConfig) and spec.path == str(Path(tiny["hf"]).resolve())
        assert (spec.model_type, spec.vocab, spec.max_seq, spec.layers, spec.heads, spec.hidden) == (
            "llama", LMConfig().vocab, 48, 2, 4, 64)
    assert not Path(tiny["hf"]).exists()                 # the temporary directory is gone


def test_bad_options_are_refused_before_any_rank_starts(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert (bench._ahead("none"), bench._ahead("3")) == (None, 3)
    with pytest.raises(SystemExit, match="--pipeline-ahead=4: only with --pipelined"):
        bench.main(["--pipeline-ahead", "4"])
    with pytest.raises(SystemExit):
        bench.main(["--pipelined", "--pipeline-ahead", "0"])
    assert "'0': a number of requests, at least 1, or none (no bound)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="one model or the other"):
        bench.main(["--hf-tiny", "gpt2", "--hf", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--hf: path=.*not a directory with a config\.json"):
        bench.main(["--hf", str(tmp_path)])
