"""add_wallfacer_args as Megatron-LM's extra_args_provider, and WallFacerConfig.from_args validation."""

import argparse
import warnings

import pytest

from megatron_patches.args import WallFacerConfig, add_wallfacer_args


def _megatron_parser():
    """The Megatron-LM arguments from_args reads (names and types of megatron/training/arguments.py)."""
    p = argparse.ArgumentParser()
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--cp-comm-type", nargs="+", default=["p2p"])
    p.add_argument("--recompute-granularity", default=None)
    p.add_argument("--recompute-modules", nargs="*", default=None)
    return p


def _parse(line: str):
    return add_wallfacer_args(_megatron_parser()).parse_args(line.split())


BASE = "--context-parallel-size 8 --seq-length 4096 --num-attention-heads 8 --attention-dropout 0"


def test_defaults_and_values():
    cfg = WallFacerConfig.from_args(_parse(BASE))
    assert cfg == WallFacerConfig(context_parallel_size=8)
    cfg = WallFacerConfig.from_args(_parse(
        BASE + " --wallfacer-team-size 2 --wallfacer-placement node-aware --wallfacer-kernel sdpa"
        " --wallfacer-backward q --wallfacer-ranks-per-node 4 --wallfacer-bandwidth 300 25 12.5"
        " --wallfacer-latency 2 15 --wallfacer-tflops 150"))
    assert (cfg.team_size, cfg.placement, cfg.kernel, cfg.backward, cfg.ranks_per_node) == (
        2, "node-aware", "sdpa", "q", 4)
    assert cfg.bandwidth_gbytes == (300.0, 25.0, 12.5)
    assert cfg.latency_us == (2.0, 15.0) and cfg.tflops == 150.0
    assert WallFacerConfig.from_args(_parse(BASE + " --wallfacer-team-size auto")).team_size == "auto"


def test_provider_chains_and_returns_the_parser():
    def mine(parser):
        parser.add_argument("--my-flag", action="store_true")
        return parser

    parser = add_wallfacer_args(mine(_megatron_parser()))
    args = parser.parse_args((BASE + " --my-flag --wallfacer-team-size 2").split())
    assert args.my_flag and args.wallfacer_team_size == 2


@pytest.mark.parametrize("extra, message", [
    (" --wallfacer-team-size 4",
     "--wallfacer-team-size: team_size C=4 is invalid for P=8 ranks: C² must divide P (valid: 1, 2)"),
    (" --seq-length 4008", "--seq-length 4008 must be divisible by 2 x --context-parallel-size = 16"),
    (" --attention-dropout 0.1", "--attention-dropout 0.1: WallFacer has no attention dropout"),
    (" --cp-comm-type a2a", "--cp-comm-type a2a: WallFacer replaces"),
    (" --num-query-groups 3", "--num-attention-heads 8, --num-query-groups 3"),
    (" --tensor-model-parallel-size 3", "--tensor-model-parallel-size 3"),
])
def test_bad_arguments(extra, message):
    with pytest.raises(ValueError) as err:
        WallFacerConfig.from_args(_parse(BASE + extra))
    assert message in str(err.value)


def test_argparse_rejects_bad_choices():
    with pytest.raises(SystemExit):
        _parse(BASE + " --wallfacer-team-size two")
    with pytest.raises(SystemExit):
        _parse(BASE + " --wallfacer-placement random")


def test_config_checks_its_own_values():
    with pytest.raises(ValueError, match="team_size=0 must be an int >= 1 or 'auto'"):
        WallFacerConfig(team_size=0)
    with pytest.raises(ValueError, match="kernel='cudnn' is not one of"):
        WallFacerConfig(kernel="cudnn")
    with pytest.raises(ValueError, match="must be > 0"):
        WallFacerConfig(bandwidth_gbytes=(0.0, 1.0, 1.0))


def test_core_attention_recompute_warns():
    with pytest.warns(UserWarning, match="recomputes WallFacer's whole distributed forward"):
        WallFacerConfig.from_args(_parse(BASE + " --recompute-granularity selective"
                                                " --recompute-modules core_attn"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WallFacerConfig.from_args(_parse(BASE + " --recompute-granularity full"))
