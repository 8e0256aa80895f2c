"""The input rules on gathered metadata (checks.input_error): one process, any number of ranks."""

import torch

from megatron_patches.checks import _encode, input_error


def _meta(s=4, b=2, hq=4, hkv=2, d=8, dtype=torch.float32, c=2, layout="zigzag", scale=None, v_d=None):
    q = torch.empty(s, b, hq, d, dtype=dtype)
    k = torch.empty(s, b, hkv, d, dtype=dtype)
    v = torch.empty(s, b, hkv, v_d or d, dtype=dtype)
    return _encode(q, k, v, c, True, scale, layout)


def test_good_inputs_pass_for_any_world():
    for world, c in ((4, 2), (8, 2), (16, 4), (64, 8), (1, 1)):
        assert input_error([_meta(c=c)] * world, "zigzag") is None


def test_rules_name_value_and_rule():
    cases = {
        "sequence length 48 (= P·s_local = 16·3) must be divisible by 2·P = 32": [_meta(s=3)] * 16,
        "team_size C=4 is invalid for P=8 ranks: C² must divide P (valid: 1, 2)": [_meta(c=4)] * 8,
        "q has 6 heads and k/v have 4": [_meta(hq=6, hkv=4)] * 4,
        "k and v must have the same shape": [_meta(v_d=4)] * 4,
        "softmax_scale=-1.0 must be a finite number > 0": [_meta(scale=-1.0)] * 4,
        "layout='striped' is not one of": [_meta(layout="striped")] * 4,
    }
    for message, metas in cases.items():
        layout = "striped" if "striped" in message else "zigzag"
        error = input_error(metas, layout)
        assert error is not None and message in error, (message, error)
        assert not error.startswith("rank "), "a rule every rank breaks is reported without a rank"


def test_one_rank_out_of_line_is_named():
    metas = [_meta()] * 8
    metas[5] = _meta(s=6)
    assert input_error(metas, "zigzag").startswith("ranks disagree: rank 5 passes q [6, 2, 4, 8] float32")
    metas[5] = _meta(s=5)
    assert input_error(metas, "zigzag").startswith("rank 5: sequence length 40")
    metas[5] = _meta(dtype=torch.float16)
    assert "rank 5 passes q [4, 2, 4, 8] float16" in input_error(metas, "zigzag")
    metas[5] = _meta(c=1)
    assert "team_size=1" in input_error(metas, "zigzag")


def test_non_tensors_and_wrong_ranks_are_described():
    bad = _encode(torch.empty(4, 2, 8), None, None, 2, True, None, "zigzag")
    assert "must be 4-d tensors [s_local, batch, heads, head_dim]" in input_error([bad] * 4, "zigzag")
