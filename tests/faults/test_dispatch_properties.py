"""dispatch / combine under random shapes, dtypes, strides and route sets (issue 22, item 2).

Hypothesis draws S, M, k, E, C, a dtype, a memory layout for every tensor (contiguous; a transposed view;
every other row of a larger tensor; stride 0 along either dimension) and a route set (valid; with a
duplicated slot; with indices below -1 or beyond E and locations outside [0, C); drawn at random over
[-3, E + 2] x [-2, C + 2]); sometimes E or C is one of the sizes that overflowed before (2**32, 2**62,
E·C beyond 2**45 slots). Two properties, each with a fixed budget of examples (derandomised, so CI sees
the same cases every run):

- the Python wrappers (``ds_plugins.dispatch``), forward and backward: on valid input, exactly the
  pure-torch reference's answer (the gate gradient within the rounding of a dot product, as
  tests/ds_plugins/test_dispatch.py); on anything else a ValueError, and nothing allocated before it;
- the C++ entry points (``torch.ops.commweave.*``) called directly: ``find_route_fault`` reports what the
  torch fault finder reports; every op gives the reference's answer where its inputs are in range (combine
  and dispatch's backward read slots and tolerate two routes on one), an error from a ``commweave:``
  check otherwise (a ValueError for sizes), never a crash.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_plugins import dispatch as ops
from ds_plugins import reference

pytestmark = [pytest.mark.fault("refused or harmless", kind="kernel sizes and routes (property)"),
              pytest.mark.skipif(ops.backend("cpu") != "cpu", reason="build ds_plugins._C first")]

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LAYOUTS = ["contiguous", "transposed", "every other row", "stride 0 rows", "stride 0 columns"]
ROUTE_SETS = ["valid", "duplicate slot", "index out of range", "location out of range", "random"]
# (E, C) that the int32 / int64 / 2**47-byte rules refuse before anything is allocated
HUGE = [(2**32, 2**32), (2**62, 4), (2, 2**31), (2**31, 2), (2**31 - 1, 2**31 - 1), (2**23, 2**23),
        (2**64, 1), (1, 2**63 - 1)]
EXAMPLES = 250
FAST = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to ``values`` [a, b] (after broadcasting for the stride-0 layouts) in ``layout``."""
    a, b = values.shape
    if layout == "transposed":
        return values.t().contiguous().t()
    if layout == "every other row":
        big = values.new_zeros(2 * a, b)
        big[::2] = values
        return big[::2]
    if layout == "stride 0 rows":
        return values[:1].expand(a, b) if a else values
    if layout == "stride 0 columns":
        return values[:, :1].expand(a, b) if b else values
    return values.contiguous()


@st.composite
def cases(draw):
    k, s, m = draw(st.integers(1, 3)), draw(st.integers(0, 10)), draw(st.integers(0, 6))
    e, c = draw(st.integers(1, 5)), draw(st.integers(0, 6))
    huge = draw(st.sampled_from([None] * 3 * len(HUGE) + HUGE))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["valid"] * 4 + ROUTE_SETS))
    idx = torch.full((k, s), -1, dtype=torch.int32)
    loc = torch.zeros((k, s), dtype=torch.int32)
    slots = torch.randperm(max(e * c, 1), generator=gen)[: k * s]
    live = torch.rand(len(slots), generator=gen) < 0.7
    flat_i, flat_l = idx.view(-1), loc.view(-1)
    if e * c:
        flat_i[: len(slots)] = torch.where(live, slots // c, -1).int()
        flat_l[: len(slots)] = torch.where(live, slots % c, 0).int()
    if kind == "random":
        idx = torch.randint(-3, e + 3, (k, s), generator=gen, dtype=torch.int32)
        loc = torch.randint(-2, c + 3, (k, s), generator=gen, dtype=torch.int32)
    elif kind != "valid" and k * s:
        r = int(torch.randint(k * s, (1,), generator=gen))
        if kind == "duplicate slot" and k * s > 1 and e * c:
            other = (r + 1) % (k * s)
            idx.view(-1)[r], loc.view(-1)[r] = 0, 0
            idx.view(-1)[other], loc.view(-1)[other] = 0, 0
        elif kind == "index out of range":
            idx.view(-1)[r] = draw(st.sampled_from([-2, -3, e, e + 1, 2**31 - 1]))
        elif kind == "location out of range":
            idx.view(-1)[r] = 0
            loc.view(-1)[r] = draw(st.sampled_from([-1, c, c + 5, 2**31 - 1]))
    x = torch.randn(s, m, generator=gen).to(dtype)
    eo = torch.randn(e, c, m, generator=gen).to(dtype)
    gates = torch.rand(k, s, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return dict(x=_laid_out(x, draw(st.sampled_from(LAYOUTS))),
                idx=_laid_out(idx, draw(st.sampled_from(["contiguous"] * 4 + LAYOUTS))),
                loc=_laid_out(loc, draw(st.sampled_from(["contiguous"] * 4 + LAYOUTS))),
                eo=eo if draw(st.booleans()) else eo.transpose(0, 1).contiguous().transpose(0, 1),
                gates=_laid_out(gates, draw(st.sampled_from(LAYOUTS))),
                e=e if huge is None else huge[0], c=c if huge is None else huge[1], dtype=dtype)


def _faults(idx: torch.Tensor, loc: torch.Tensor, e: int, c: int) -> tuple[bool, bool]:
    """(every index and live location in range, no two live routes on one slot), from plain Python."""
    pairs = list(zip(idx.reshape(-1).tolist(), loc.reshape(-1).tolist(), strict=True))
    in_range = all(i == -1 or (0 <= i < e and 0 <= j < c) for i, j in pairs)
    live = [(i, j) for i, j in pairs if i >= 0]
    return in_range, len(set(live)) == len(live)


def _fits(case) -> bool:
    e, c = case["e"], case["c"]
    return e < 2**31 and c < 2**31 and e * c * 4 <= 2**47


@FAST
@given(cases())
def test_the_wrappers_give_the_references_answer_or_a_value_error(case):
    x, idx, loc, eo, gates, e, c = (case[n] for n in ("x", "idx", "loc", "eo", "gates", "e", "c"))
    in_range, unique = _faults(idx, loc, e, c)
    if not (_fits(case) and in_range and unique):
        with pytest.raises(ValueError):
            ops.dispatch(x, idx, loc, e, c)
        if _fits(case) and eo.shape[:2] == (e, c):
            with pytest.raises(ValueError):
                ops.combine(eo, idx, loc, gates)
        return
    xg, eog, gg = (t.detach().requires_grad_(True) for t in (x, eo, gates))
    out = ops.dispatch(xg, idx, loc, e, c)
    y = ops.combine(eog, idx, loc, gg)
    assert torch.equal(out, reference.dispatch(x, idx, loc, e, c))
    assert torch.equal(y, reference.combine(eo, idx, loc, gates))
    d_out, d_y = torch.randn_like(out), torch.randn_like(y)
    torch.autograd.backward([out, y], [d_out, d_y])
    assert torch.equal(xg.grad, reference.dispatch_backward(d_out, idx, loc, x.shape[0]))
    want_expert, want_gates = reference.combine_backward(d_y, eo, idx, loc, gates)
    assert torch.equal(eog.grad, want_expert)
    tol = 1e-12 if case["dtype"] == torch.float64 else 1e-5
    torch.testing.assert_close(gg.grad, want_gates, rtol=tol, atol=tol)


def _op_or_error(fn, *args):
    """fn's result, or None after an error from one of the ops' own checks (never anything else)."""
    try:
        return fn(*args)
    except (RuntimeError, ValueError) as e:
        assert "commweave" in str(e), str(e)
        return None


@FAST
@given(cases())
def test_the_cpp_entry_points_give_the_references_answer_or_a_clear_error(case):
    x, idx, loc, eo, gates, e, c = (case[n] for n in ("x", "idx", "loc", "eo", "gates", "e", "c"))
    ok = torch.ops.commweave
    if not _fits(case):  # the sizes the int32 / 2**47-byte rules refuse: an error, before any allocation
        with pytest.raises((RuntimeError, ValueError), match="commweave"):
            ok.find_route_fault(idx, loc, e, c)
        with pytest.raises((RuntimeError, ValueError), match="commweave"):
            ok.dispatch(x, idx, loc, e, c)
        return
    in_range, unique = _faults(idx, loc, e, c)
    fault = _op_or_error(ok.find_route_fault, idx, loc, e, c)
    assert fault == ops._find_route_fault_torch(idx, loc, e, c)
    assert (fault == []) == (in_range and unique)

    out = _op_or_error(ok.dispatch, x, idx, loc, e, c)
    assert (out is None) == (not (in_range and unique))
    if out is not None:
        assert torch.equal(out, reference.dispatch(x, idx, loc, e, c))
    grad = torch.randn(e, c, x.shape[1], dtype=x.dtype)
    dx = _op_or_error(ok.dispatch_backward, grad, idx, loc, x.shape[0])
    assert (dx is None) == (not in_range)
    if dx is not None:  # a gather: two routes on one slot both read it
        assert torch.equal(dx, reference.dispatch_backward(grad, idx, loc, x.shape[0]))
    y = _op_or_error(ok.combine, eo, idx, loc, gates)
    assert (y is None) == (not in_range)
    if y is not None:
        assert torch.equal(y, reference.combine(eo, idx, loc, gates))
    dy = torch.randn(x.shape[0], eo.shape[2], dtype=eo.dtype)
    grads = _op_or_error(ok.combine_backward, dy, eo, idx, loc, gates, True, True)
    assert (grads is None) == (not (in_range and unique))
    if grads is not None:
        want_expert, want_gates = reference.combine_backward(dy, eo, idx, loc, gates)
        assert torch.equal(grads[0], want_expert)
        tol = 1e-12 if case["dtype"] == torch.float64 else 1e-5
        torch.testing.assert_close(grads[1], want_gates, rtol=tol, atol=tol)
