"""Autograd-aware collectives on explicit process groups, each with its dual (parm.md §2.7).

=====================  ===========================  ==============================================
function               forward                      backward
=====================  ===========================  ==============================================
all_to_all             A2A                          A2A
copy_to                identity                     all-reduce (Megatron's f)
reduce_from            all-reduce                   identity   (Megatron's g)
split_rows             keep this rank's row block   all-gather of the blocks
gather_rows            all-gather of the blocks     keep this rank's row block (the consumer is
                                                    replicated, so every rank holds the full grad)
=====================  ===========================  ==============================================

Row blocks may be uneven (``torch.tensor_split`` sizes); the all-gather pads every block to the largest
one so that it is a single equal-size collective (parm.md §2.8, "S1: S to a multiple of N_MP").
A ``group`` of ``None`` means a group of one rank: every function is then the identity.
"""

from __future__ import annotations

import torch

from commweave import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_blocks(rows: int, n: int) -> list[int]:
    """The sizes of ``torch.tensor_split``'s n blocks of ``rows`` rows (the first rows % n one larger)."""
    return [t.numel() for t in torch.arange(rows).tensor_split(n)]


def _gather_blocks(x: torch.Tensor, group, rows: list[int]) -> torch.Tensor:
    """All-gather row blocks of sizes ``rows`` (this rank holds ``x``), padding each to the largest."""
    n, width = len(rows), max(rows)
    if min(rows) == width:  # equal blocks: straight into the result, no padding and no copies
        out = x.new_empty((n * width, *x.shape[1:]))
        comm.all_gather(out, x, group)
        return out
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((n, width, *x.shape[1:]))
    comm.all_gather(out, padded, group)
    return torch.cat([out[q, : rows[q]] for q in range(n)])


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, row_blocks(x.shape[0], comm.size(group))
        return x.tensor_split(comm.size(group))[comm.rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_blocks(grad.contiguous(), ctx.group, ctx.rows), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, total_rows):
        ctx.group = group
        return _gather_blocks(x.contiguous(), group, row_blocks(total_rows, comm.size(group)))

    @staticmethod
    def backward(ctx, grad):
        return grad.tensor_split(comm.size(ctx.group))[comm.rank(ctx.group)].contiguous(), None, None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, group)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFrom.apply(x, group)


def split_rows(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _SplitRows.apply(x, group)


def gather_rows(x: torch.Tensor, group, total_rows: int) -> torch.Tensor:
    return x if group is None else _GatherRows.apply(x, group, total_rows)
