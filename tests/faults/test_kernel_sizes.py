"""Sizes that overflowed the kernels, and route tensors changed behind dispatch's back (issue 22).

Before: ``dispatch(x, idx, loc, num_experts=2**32, capacity=2**32)`` and ``(2**62, 4)`` segfaulted (E·C
wrapped to 0 in int64, the route check's owner vector was empty and the first live route wrote past it);
huge capacities or experts gave ``std::bad_alloc``; a stride-0 x of 2**40 columns an allocator error after
a 16 TB request; 2**64 a pybind11 cast error. Now each is a ValueError naming the argument, the value and
the rule, from the Python wrappers and, for direct callers, from the C++ ops (TORCH_CHECK_VALUE), before
anything is allocated. The cases run in a spawned child (tests/faults/corpus.py ``isolated``), so that a
regression counts as a crash instead of killing the test run.
"""

from __future__ import annotations

import pytest
import torch

from ds_plugins import dispatch as ops
from tests.faults import corpus

pytestmark = [pytest.mark.skipif(ops.backend("cpu") != "cpu", reason="build ds_plugins._C first")]


def _routes():
    x = torch.randn(4, 3)
    idx = torch.tensor([[0, 1, 0, 1]], dtype=torch.int32)
    loc = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    return x, idx, loc, torch.ones(1, 4)


def _dispatch(e, c, x=None):
    x0, idx, loc, _ = _routes()
    return ops.dispatch(x0 if x is None else x, idx, loc, e, c)


def _wide(e, c):
    x, idx, loc, _ = _routes()
    return torch.ops.commweave.dispatch(x, idx, loc, e, c)


def _find(e, c):
    _, idx, loc, _ = _routes()
    return torch.ops.commweave.find_route_fault(idx, loc, e, c)


def _long_routes(k, s):
    return torch.zeros(1, 1, dtype=torch.int32).expand(k, s)


CASES = {  # name -> a call that must be refused; (name, texts it must say, error type)
    "dispatch E=C=2**32": lambda: _dispatch(2**32, 2**32),
    "dispatch E=2**62 C=4": lambda: _dispatch(2**62, 4),
    "dispatch E=2**40": lambda: _dispatch(2**40, 2),
    "dispatch C=2**40": lambda: _dispatch(2, 2**40),
    "dispatch C=2**31": lambda: _dispatch(2, 2**31),
    "dispatch E=2**64": lambda: _dispatch(2**64, 2),
    "dispatch E=C=2**23 (slot table 2**48 bytes)": lambda: _dispatch(2**23, 2**23, torch.zeros(4, 0)),
    "dispatch output 2**48 bytes": lambda: _dispatch(2**20, 2**20, torch.zeros(4, 64)),
    "dispatch stride-0 x of 2**40 columns": lambda: _dispatch(2, 2, torch.zeros(4, 1).expand(4, 2**40)),
    "combine stride-0 expert_output 2**48 bytes": lambda: ops.combine(
        torch.zeros(1, 1, 1).expand(2**20, 2**20, 64), *_routes()[1:]),
    "combine stride-0 routes k·S = 2**32": lambda: ops.combine(
        torch.zeros(2, 2, 3), _long_routes(2, 2**31), _long_routes(2, 2**31),
        torch.zeros(1, 1).expand(2, 2**31)),
    "op dispatch E=C=2**32": lambda: _wide(2**32, 2**32),
    "op dispatch E=2**62 C=4": lambda: _wide(2**62, 4),
    "op dispatch E=C=2**31-1": lambda: _wide(2**31 - 1, 2**31 - 1),
    "op find_route_fault E=2**62 C=4": lambda: _find(2**62, 4),
    "op find_route_fault C=2**40": lambda: _find(2, 2**40),
    "op dispatch stride-0 x of 2**48 bytes": lambda: torch.ops.commweave.dispatch(
        torch.zeros(4, 1).expand(4, 2**44), *_routes()[1:3], 2, 2),
    "op combine stride-0 expert_output": lambda: torch.ops.commweave.combine(
        torch.zeros(1, 1, 1).expand(2**31 - 1, 2**20, 1), *_routes()[1:]),
    "op dispatch_backward stride-0 grad E=2**31": lambda: torch.ops.commweave.dispatch_backward(
        torch.zeros(1, 1, 3).expand(2**31, 1, 3), *_routes()[1:3], 4),
    "op combine routes k·S = 2**32": lambda: torch.ops.commweave.combine(
        torch.zeros(2, 2, 3), _long_routes(2, 2**31), _long_routes(2, 2**31),
        torch.zeros(1, 1).expand(2, 2**31)),
}

EXPECTED = {  # name -> the texts the refusal must hold (the argument, the value, the rule)
    "dispatch E=C=2**32": ["num_experts=4294967296", "[1, 2147483647] (expert indices are int32)"],
    "dispatch E=2**62 C=4": ["num_experts=4611686018427387904", "expert indices are int32"],
    "dispatch E=2**40": ["num_experts=1099511627776", "expert indices are int32"],
    "dispatch C=2**40": ["capacity=1099511627776", "[0, 2147483647] (locations are int32)"],
    "dispatch C=2**31": ["capacity=2147483648", "locations are int32"],
    "dispatch E=2**64": ["num_experts=18446744073709551616", "expert indices are int32"],
    "dispatch E=C=2**23 (slot table 2**48 bytes)": ["the slot table [E·C] int32='8388608 x 8388608 x 4'",
                                                    "281474976710656 bytes"],
    "dispatch output 2**48 bytes": ["the output [E, C, M]='1048576 x 1048576 x 64 x 4'", "bytes, more than"],
    "dispatch stride-0 x of 2**40 columns": ["x [S, M]='4 x 1099511627776 x 4'", "17592186044416 bytes"],
    "combine stride-0 expert_output 2**48 bytes": ["expert_output [E, C, M]='1048576 x 1048576 x 64 x 4'"],
    "combine stride-0 routes k·S = 2**32": ["indices [k, S]='2 x 2147483648'",
                                            "routes (numbered j·S + s in int32)"],
    "op dispatch E=C=2**32": ["commweave: num_experts must be in [1, 2147483647]", "got 4294967296"],
    "op dispatch E=2**62 C=4": ["commweave: num_experts must be in", "got 4611686018427387904"],
    "op dispatch E=C=2**31-1": ["commweave: the size of the slot table [E * C] int32 overflows int64"],
    "op find_route_fault E=2**62 C=4": ["commweave: num_experts must be in", "got 4611686018427387904"],
    "op find_route_fault C=2**40": ["commweave: capacity must be in [0, 2147483647]", "got 1099511627776"],
    "op dispatch stride-0 x of 2**48 bytes": ["commweave: x [S, M] [4, 17592186044416] would take",
                                              "more than 2**47"],
    "op combine stride-0 expert_output": ["commweave: the slot table [E * C] int32 would take",
                                          "more than 2**47"],
    "op dispatch_backward stride-0 grad E=2**31": ["commweave: num_experts must be in", "got 2147483648"],
    "op combine routes k·S = 2**32": ["commweave: k * S must fit in int32", "k = 2, S = 2147483648"],
}


@pytest.fixture(scope="module")
def outcomes():
    return corpus.isolated(__name__, "CASES", list(CASES), timeout=120)


@pytest.mark.fault("refused", kind="kernel sizes")
@pytest.mark.parametrize("name", list(CASES))
def test_overflowing_sizes_are_refused_before_any_allocation(outcomes, name):
    outcomes[name].check_refused(*EXPECTED[name])


# ---------------------------------------------------------------------------------------------------------
# Route tensors changed after dispatch: combine checks them again, whatever wrote them
# ---------------------------------------------------------------------------------------------------------

def _collide_in_place(loc):
    loc[0, 2] = 0


def _collide_through_data(loc):
    loc.data[0, 2] = 0           # .data has its own version counter: loc._version does not move


def _collide_through_numpy(loc):
    loc.numpy()[0, 2] = 0        # nor through numpy's view of the storage


def _collide_through_dlpack(loc):
    torch.from_dlpack(loc)[0, 2] = 0   # a new tensor on the same storage, with a version counter of its own


WRITES = {"in place": _collide_in_place, ".data": _collide_through_data, "numpy": _collide_through_numpy,
          "dlpack": _collide_through_dlpack}


@pytest.mark.fault("refused", kind="dispatch routes changed after dispatch")
@pytest.mark.parametrize("write", list(WRITES))
def test_combine_checks_routes_changed_after_dispatch(write):
    x, idx, loc, gates = _routes()
    expert_output = ops.dispatch(x, idx, loc, 2, 2)
    ops.combine(expert_output, idx, loc, gates)
    WRITES[write](loc)
    corpus.refused(lambda: ops.combine(expert_output, idx, loc, gates),
                   "routes (j=0, s=0) and (j=0, s=2) both claim expert 0, location 0")
