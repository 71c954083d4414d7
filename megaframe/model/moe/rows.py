"""The MoE dispatcher's row moves as autograd Functions whose backward needs only the indices.

Legend: T rows in (tokens), A rows out (assignments), D hidden.

`gather_rows(x_TD, index_A)` is x_TD[index_A] (a token's row to each of its assignments, or a
permutation); `scatter_rows(y_AD, index_A, T)` sums each row into its slot of a [T, D] zero tensor (the
combine: a token's K expert outputs; or a permutation's inverse). Each saves its index alone, never a
[rows, D] tensor: autograd's own index_add saves its `source` rows for backward (the derivative formula
names it for its shape), which the combine would hold as a copy of every routed row. The backward ops
are the ones autograd runs for x[index] and index_add (index_put with accumulate, index_select), so the
grads are the same bits as before.
"""

from __future__ import annotations

import torch


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, index_A):
        ctx.save_for_backward(index_A)
        ctx.rows = x_TD.shape[0]
        return x_TD[index_A]

    @staticmethod
    def backward(ctx, g_AD):
        (index_A,) = ctx.saved_tensors
        g_TD = g_AD.new_zeros((ctx.rows, *g_AD.shape[1:]))
        return g_TD.index_put_((index_A,), g_AD, accumulate=True), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_AD, index_A, rows: int):
        ctx.save_for_backward(index_A)
        return y_AD.new_zeros((rows, *y_AD.shape[1:])).index_add_(0, index_A, y_AD)

    @staticmethod
    def backward(ctx, g_TD):
        (index_A,) = ctx.saved_tensors
        return g_TD.index_select(0, index_A), None, None


def gather_rows(x_TD: torch.Tensor, index_A: torch.Tensor) -> torch.Tensor:
    """x_TD[index_A]; its backward sums the grads of each source row's copies (saves index_A only)."""
    return _GatherRows.apply(x_TD, index_A)


def scatter_rows(y_AD: torch.Tensor, index_A: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, D] zeros with y_AD's rows summed in at index_A; its backward gathers (saves index_A only)."""
    return _ScatterRows.apply(y_AD, index_A, rows)
