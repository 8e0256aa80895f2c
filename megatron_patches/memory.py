"""Memory traffic: the bytes a plan's code path moves through memory outside its kernel blocks, counted on
the code itself, and the seconds the cost model gives them at a measured copy bandwidth.

Besides its kernels (the attention curves price each block call together with its merge into the running
output or its gradients' accumulation, calibrate._attention) and its messages, a WallFacer call touches
memory in code whose bytes grow with the sizes: the team all-gathers' receive buffers sorted into stream
order (rowmap pieces), the send and receive buffers of the ring hops and placement moves filled by copies,
the accumulators zeroed, the row sums D = rowsum(dO∘O), dtype casts, the hybrid's head reorders. host.py
measures a plan's code at 16 rows per rank, where that traffic is small; at a training size it is not.

Count (:func:`traced_bytes`): a TorchDispatchMode sees every ATen op the call runs on this rank. Each op
that is not a view and not a collective (c10d) counts the bytes of its tensor inputs plus those of its
outputs that are new memory (an in-place op's result is its first input: counted once). So a copy counts
source + destination, a zeroing its buffer once, an add_ both operands. Not counted, because something
else prices them or nothing moves:

- ops inside steps.attend / steps.attend_backward (:func:`kernel_part`: the blocks, their merges and
  accumulations, what the curves already price);
- ops inside commweave.comm's message functions (MESSAGE_FUNCTIONS: the collectives, the point-to-point
  posts, the waits that finish them): the calibration's link and collective microbenchmarks time those
  very functions, so their copies (the pairwise all-gather's copy of a rank's input onto its slot, a
  no-op when, as in team.gather_team, the input is that slot) and the reduce-scatter's sum are in the
  messages' measured seconds already (P = 4, 512 rows x 8 heads: 103 of C = 2's 261 kB per row);
- allocations (ALLOCATIONS: empty, empty_like, new_empty, ...) touch no byte (whatever fills the buffer
  counts it), and an op that writes nothing and returns only its inputs' storage (_unsafe_view, a view
  the schema does not mark) moves nothing: counted as inputs plus a new output, these gave U = 2 and
  U = 4 at P = 4 72 kB per row of their 216 and 189 kB, C = 2 8 kB, ring attention none.

The traffic of a dense plan is linear in the rows per rank s (every op's tensors are row ranges of
[s, b, h, d] or [C·s, ...] buffers; the number of ops is set by the plan's structure), so two traced sizes
give it exactly:

    row_bytes(U, C, order) = (bytes(2·HOST_ROWS) − bytes(HOST_ROWS)) / HOST_ROWS      per rank and row

Price (Profile.memory_s): row_bytes × (s − HOST_ROWS) × (b·h·d·elt) / (b·h·d·elt of the trace) at the
measured copy bandwidth (:func:`copy_step`: copy_ between two buffers of COPY_BYTES, counted as above:
2 × COPY_BYTES per call), in the profile's clock. The rows below HOST_ROWS are host.py's (its tiny run
holds them). Scaling by b·h·d·elt takes every counted tensor as [rows, b, h, d]; the lse and D rows
([b, h, rows], fp32) scale by b·h only, a share of 1/d of the traffic, which this over-prices at larger d.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPY_BYTES = 4 << 20   # the copy the bandwidth is measured on: 4 MiB, the order of one [s, b, h, d] buffer
# ATen ops that only allocate (the module docstring); their overload packets' names.
ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
# commweave.comm's functions whose work the link and collective microbenchmarks time (calibrate.py):
# (owner attribute path, name). Handle.wait holds the reduce-scatter's sum (its finish step).
MESSAGE_FUNCTIONS = (("", "all_gather"), ("", "reduce_scatter"), ("", "all_to_all"), ("", "batch_p2p"),
                     ("Handle", "wait"))

_active: list[_Traffic] = []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Traffic(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.paused = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused or func.is_view or func.namespace == "c10d" \
                or func.overloadpacket.__name__ in ALLOCATIONS:
            return out
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        seen = {_storage(t) for t in ins}
        if outs and not func._schema.is_mutable and all(_storage(t) in seen for t in outs):
            return out  # an alias the schema does not mark as a view (_unsafe_view): nothing moves
        self.bytes += sum(t.numel() * t.element_size() for t in ins)
        self.bytes += sum(t.numel() * t.element_size() for t in outs if _storage(t) not in seen)
        return out


@contextlib.contextmanager
def kernel_part():
    """The part of a call the attention curves price (steps.attend, steps.attend_backward): not counted."""
    if not _active:
        yield
        return
    _active[-1].paused += 1
    try:
        yield
    finally:
        _active[-1].paused -= 1


def _paused(fn):
    """``fn`` with the innermost count paused while it runs (kernel_part as a wrapper)."""
    def inner(*args, **kwargs):
        with kernel_part():
            return fn(*args, **kwargs)
    return inner


@contextlib.contextmanager
def _messages_paused():
    """commweave.comm's MESSAGE_FUNCTIONS wrapped to pause the count while the trace runs, restored after
    (the callers look them up on the module or the class at each call, as wallfacer.py, team.py and
    groups.py do)."""
    from commweave import comm

    saved = []
    for path, name in MESSAGE_FUNCTIONS:
        owner = getattr(comm, path) if path else comm
        saved.append((owner, name, owner.__dict__[name]))
    try:
        for owner, name, fn in saved:
            setattr(owner, name, _paused(fn))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def traced_bytes(fn) -> int:
    """Bytes ``fn()`` moves outside its kernel parts and messages on this rank (the count in the module
    docstring)."""
    mode = _Traffic()
    _active.append(mode)
    try:
        with _messages_paused(), mode:
            fn()
    finally:
        _active.pop()
    return mode.bytes


def row_bytes(small, large, rows: int) -> float:
    """Bytes per row per rank of one plan: ``small`` and ``large`` run it on ``rows`` and 2·``rows`` rows."""
    return (traced_bytes(large) - traced_bytes(small)) / rows


def copy_step(device, dtype=torch.float32):
    """One copy_ of COPY_BYTES between two buffers (2·COPY_BYTES counted), for the bandwidth's timing."""
    src = torch.ones(COPY_BYTES // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)
