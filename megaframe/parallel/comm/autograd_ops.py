"""The autograd-aware collectives layers call: tp copy / reduce, sp scatter / gather / reduce-scatter
along the sequence (dim 0), cp's K/V gather, expert parallelism's uneven all-to-all; each the identity
on an axis of size 1, and each pair the other's adjoint in backward."""

from __future__ import annotations

import torch

from megaframe.parallel.comm.plain import (
    all_gather_dim0,
    all_reduce,
    all_to_all_rows,
    reduce_scatter_dim0,
    split_dim0,
)
from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Axis


class _CopyToTP(torch.autograd.Function):
    """forward: identity (input replicated on tp); backward: all-reduce grads over tp."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, g):
        # Each tp rank's downstream consumes x through its own weight shard, so x's grad is the sum of them.
        return all_reduce(g.contiguous(), ctx.axis), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce partial sums over tp; backward: identity."""

    @staticmethod
    def forward(ctx, x, axis):
        # all_reduce works in place: the clone leaves the caller's x (which autograd may hold) unmodified.
        return all_reduce(x.contiguous().clone() if axis.size > 1 else x, axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToSP(torch.autograd.Function):
    """forward: keep this rank's sequence block (dim 0); backward: all-gather the seq dim."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return split_dim0(x, axis)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.axis), None


class _GatherFromSP(torch.autograd.Function):
    """forward: all-gather the seq dim; backward: reduce-scatter of the grads. sp: before a column-parallel
    layer; cp: K and V (every rank's queries attended to every rank's K/V, so each block's grad is a sum)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return all_gather_dim0(x, axis)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g, ctx.axis), None


class _ReduceScatterToSP(torch.autograd.Function):
    """forward: reduce-scatter partial sums over the seq dim
    (after a row-parallel layer); backward: all-gather."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return reduce_scatter_dim0(x, axis)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.axis), None


# The collectives run eagerly even inside a torch.compile'd block (train.compile): dynamo would guard
# on the byte counters and recompile every step. At size 1 they are the identity and compile away.
_eager = {
    f: eager(f.apply) for f in (_CopyToTP, _ReduceFromTP, _ScatterToSP, _GatherFromSP, _ReduceScatterToSP)
}


def gather_from_cp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """K or V of the whole cp group (context parallelism, cp_comm=allgather); bytes count as cp."""
    return _eager[_GatherFromSP](x, axis) if axis.size > 1 else x  # the sp gather's op, over cp


def copy_to_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_CopyToTP](x, axis)


def reduce_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_ReduceFromTP](x, axis)


def scatter_to_sp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_ScatterToSP](x, axis)


def gather_from_sp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_GatherFromSP](x, axis)


def reduce_scatter_to_sp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_ReduceScatterToSP](x, axis)


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with splits s; backward: all-to-all with the reversed splits.

    s = (out_splits, in_splits) as in `all_to_all_rows`; the gradient of the rows we received goes back
    to the ranks that sent them (out and in swapped), so the pair is its own adjoint."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.splits = axis, (out_splits, in_splits)
        return all_to_all_rows(x, axis, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(g, ctx.axis, in_splits, out_splits), None, None, None


def all_to_all(x: torch.Tensor, axis: Axis, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Autograd-aware uneven all-to-all of rows over `axis` (expert-parallel token dispatch)."""
    return x if axis.size == 1 else _AllToAll.apply(x, axis, list(out_splits), list(in_splits))
