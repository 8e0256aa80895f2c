"""benchmarks.dispatch compares like with like: every method computes the same output and input
gradient from the same routes, and the byte count follows its docstring."""

import pytest
import torch

from benchmarks import dispatch as bench


@pytest.mark.parametrize("k", [2, 4])
def test_methods_agree(k):
    case = bench.make_case(tokens=128, d_model=16, experts=8, k=k, capacity_factor=0.75,
                           dtype=torch.float32, device="cpu")
    assert 0 < case.live < case.indices.numel()  # some routes dropped by the capacity
    y_ours, dx_ours = bench.METHODS["ours"](case)()
    for name in ("deepspeed", "megatron"):
        y, dx = bench.METHODS[name](case)()
        torch.testing.assert_close(y, y_ours, msg=name)
        torch.testing.assert_close(dx, dx_ours, msg=name)


def test_must_move_bytes():
    case = bench.make_case(tokens=64, d_model=8, experts=4, k=2, capacity_factor=1.0, dtype=torch.bfloat16,
                           device="cpu")
    k, tokens = case.indices.shape
    slots, live = case.num_experts * case.capacity, case.live
    routed = int((case.indices >= 0).any(0).sum())
    rows = routed + slots + live + tokens + tokens + live + slots + live + tokens
    assert case.must_move_bytes() == rows * 8 * 2 + k * tokens * 4 * (8 + 3)
    copy_out = bench.METHODS["copy"](case)()
    assert copy_out.numel() * copy_out.element_size() * 2 == pytest.approx(case.must_move_bytes(), abs=4)
