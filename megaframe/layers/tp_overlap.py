"""Tensor-parallel communication overlapped with the GEMMs (`parallel.tp_comm_overlap=true`, needs sp).

Legend: S/tp the local sequence block, C = S/tp/k one chunk of it, k chunks, T = tp, B batch,
I input features, O output features (local shards: O/tp for column-, I/tp for row-parallel weights).

Megatron's and torchtitan's "collective matmul", on any backend: the sequence-parallel all-gather before a
column-parallel GEMM, and the reduce-scatter after a row-parallel one, are cut into k chunks along the
local sequence; each chunk's collective is launched asynchronously and the GEMM of the chunk that has
arrived runs while the next ones are in flight.

Column-parallel (`_GatherMatmul`):
    forward:  per chunk i, all-gather x[iC:(i+1)C] -> [T, C, B, I]; y[:, i] = that @ W^T (y viewed [T, k, C,
              B, O])
    backward: per chunk, dx's reduce-scatter of g[:, i] @ W (launched as soon as it is computed), and dW from
              the chunks gathered again (only the local block is saved, as _GatheredLinear does)
Row-parallel (`_MatmulScatter`):
    forward:  per chunk i, the partial x[:, i] @ W^T -> [T, C, B, O] reduce-scattered into y[iC:(i+1)C]
    backward: per chunk, all-gather g[iC:(i+1)C], then dx[:, i] and dW's share from it

The chunked GEMMs add up the same products as the whole ones, in another blocking: equal to the
unoverlapped path up to float rounding (the tests hold it to 1e-6). Chunks come from one flat collective
each, through parallel/comm/, so the byte counts and the watchdog's ring buffer see them.
"""

from __future__ import annotations

import torch
from torch import nn

from megaframe.parallel import comm
from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Axis
from megaframe.pipeline.split import wanted


def _chunks(s: int, k: int) -> int:
    """The largest chunk count <= k that divides the local sequence block s."""
    return max(d for d in range(1, min(k, s) + 1) if s % d == 0)


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _gather_chunks(x_SBI: torch.Tensor, axis: Axis, k: int):
    """Launch the k chunk all-gathers of the local block; returns [(buffer [T, C, B, I], work)]."""
    out = []
    for x_CBI in x_SBI.chunk(k):
        # dim 0 merged: gloo checks the output's shape as [T·C, ...], not [T, C, ...]
        buf = x_CBI.new_empty((axis.size * x_CBI.shape[0], *x_CBI.shape[1:]))
        work = comm.all_gather_flat(buf, x_CBI.contiguous(), axis, async_op=True)
        out.append((buf.view(axis.size, *x_CBI.shape), work))
    return out


class _GatherMatmul(torch.autograd.Function):
    """y [T·S/tp, B, O] = all_gather_seq(x) @ W^T + b, the gather chunked under the GEMMs."""

    @staticmethod
    def forward(ctx, x_SBI, weight, bias, axis, k):
        k = _chunks(x_SBI.shape[0], k)
        ctx.axis, ctx.k, ctx.has_bias = axis, k, bias is not None
        ctx.save_for_backward(x_SBI, weight)
        s, b = x_SBI.shape[:2]
        y_TKCBO = x_SBI.new_empty((axis.size, k, s // k, b, weight.shape[0]))
        for i, (buf_TCBI, work) in enumerate(_gather_chunks(x_SBI, axis, k)):
            _wait(work)  # the later chunks' gathers stay in flight under this GEMM
            y_TKCBO[:, i] = torch.matmul(buf_TCBI, weight.t())
        y_SBO = y_TKCBO.view(axis.size * s, b, -1)
        return y_SBO if bias is None else y_SBO + bias

    @staticmethod
    def backward(ctx, g_SBO):
        x_SBI, weight = ctx.saved_tensors
        axis, k = ctx.axis, ctx.k
        s, b = x_SBI.shape[:2]
        g_TKCBO = g_SBO.contiguous().view(axis.size, k, s // k, b, -1)
        gx_SBI = gw_OI = None
        # a split backward (zero-bubble) runs this twice, B for the input grad, W for the weight's: each once
        want_x, want_w = ctx.needs_input_grad[0] and wanted(x_SBI), ctx.needs_input_grad[1] and wanted(weight)
        if want_x:
            gx_SBI = torch.empty_like(x_SBI)
            works = []
            for i, gx_CBI in enumerate(gx_SBI.chunk(k)):  # each chunk's reduce-scatter under the next GEMM
                part_TCBI = torch.matmul(g_TKCBO[:, i], weight)
                works.append(
                    (
                        comm.reduce_scatter_flat(gx_CBI, part_TCBI.flatten(0, 1), axis, async_op=True),
                        part_TCBI,
                    )
                )
            for work, _part in works:  # the partial sums stay referenced until their collective is done
                _wait(work)
        if want_w:
            gw_OI = torch.zeros_like(weight)
            for i, (buf_TCBI, work) in enumerate(_gather_chunks(x_SBI, axis, k)):
                _wait(work)
                gw_OI += g_TKCBO[:, i].reshape(-1, gw_OI.shape[0]).t() @ buf_TCBI.reshape(-1, gw_OI.shape[1])
        gb_O = g_SBO.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] and want_w else None
        return gx_SBI, gw_OI, gb_O, None, None


class _MatmulScatter(torch.autograd.Function):
    """y [S/tp, B, O] = reduce_scatter_seq(x @ W^T), the reduce-scatter chunked under the GEMMs."""

    @staticmethod
    def forward(ctx, x_SBI, weight, axis, k):
        s = x_SBI.shape[0] // axis.size
        k = _chunks(s, k)
        ctx.axis, ctx.k = axis, k
        ctx.save_for_backward(x_SBI, weight)
        x_TKCBI = x_SBI.view(axis.size, k, s // k, *x_SBI.shape[1:])
        y_SBO = x_SBI.new_empty((s, x_SBI.shape[1], weight.shape[0]))
        works = []
        for i, y_CBO in enumerate(y_SBO.chunk(k)):
            part_TCBO = torch.matmul(x_TKCBI[:, i], weight.t())
            works.append(
                (comm.reduce_scatter_flat(y_CBO, part_TCBO.flatten(0, 1), axis, async_op=True), part_TCBO)
            )
        for work, _part in works:
            _wait(work)
        return y_SBO

    @staticmethod
    def backward(ctx, g_SBO):
        x_SBI, weight = ctx.saved_tensors
        axis, k = ctx.axis, ctx.k
        s = g_SBO.shape[0]
        x_TKCBI = x_SBI.view(axis.size, k, s // k, *x_SBI.shape[1:])
        # under a split backward B and W each want one of the two; W gathers g again (not kept from B)
        gx_TKCBI = torch.empty_like(x_TKCBI) if ctx.needs_input_grad[0] and wanted(x_SBI) else None
        gw_OI = torch.zeros_like(weight) if ctx.needs_input_grad[1] and wanted(weight) else None
        for i, (g_TCBO, work) in enumerate(_gather_chunks(g_SBO.contiguous(), axis, k)):
            _wait(work)
            if gx_TKCBI is not None:
                gx_TKCBI[:, i] = torch.matmul(g_TCBO, weight)
            if gw_OI is not None:
                gw_OI += g_TCBO.reshape(-1, gw_OI.shape[0]).t() @ x_TKCBI[:, i].reshape(-1, gw_OI.shape[1])
        gx_SBI = None if gx_TKCBI is None else gx_TKCBI.view_as(x_SBI)
        return gx_SBI, gw_OI, None, None


# eager inside a torch.compile'd block, like the collectives in comm
gather_matmul = eager(_GatherMatmul.apply)
matmul_scatter = eager(_MatmulScatter.apply)


def enable_tp_overlap(model: nn.Module, chunks: int) -> int:
    """Set every tp linear (sequence-parallel, tp > 1, not an FP8 one) to the overlapped path with `chunks`
    chunks; returns how many were set."""
    n = 0
    # the tp linears are the modules with an overlap_chunks slot (layers/linear.py)
    for mod in model.modules():
        if hasattr(mod, "overlap_chunks") and mod.sp and mod.tp.size > 1:
            mod.overlap_chunks, n = chunks, n + 1
    return n
