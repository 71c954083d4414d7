"""Column- and row-parallel linear layers (Megatron's f/g pairs), each owning its communication.

Legend: S sequence (S/tp when sequence-parallel), B batch, I input features, O output features.
ColumnParallelLinear: weight [O/tp, I] (each fused block split separately), output stays split on tp.
RowParallelLinear:    weight [O, I/tp], input split on tp, output summed over tp.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.layers import tp_overlap, wgrad
from megaframe.layers.shard import Shard, sharded_param
from megaframe.parallel import comm
from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Axis
from megaframe.pipeline.split import wanted


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b under sp, saving only x's local sequence block for backward.

    Autograd through a separate gather and F.linear would keep the gathered [S, B, I] input (tp times
    the local block) until backward; Megatron instead saves the local [S/tp, B, I] block and
    all-gathers it again in backward for the weight grad: one more all-gather per layer, tp-fold
    less memory for this input."""

    @staticmethod
    def forward(ctx, x_SBI, weight, bias, axis):
        ctx.axis, ctx.has_bias = axis, bias is not None
        ctx.save_for_backward(x_SBI, weight)
        return F.linear(comm.all_gather_dim0(x_SBI, axis), weight, bias)

    @staticmethod
    def backward(ctx, g_SBO):
        x_SBI, weight = ctx.saved_tensors
        g_SBO = g_SBO.contiguous()
        # A split backward (zero-bubble, pipeline/split.py) asks twice: B for the input grad, W for the
        # weight's; `wanted` keeps each from redoing the other's GEMM and collective.
        want_x, want_w = ctx.needs_input_grad[0] and wanted(x_SBI), ctx.needs_input_grad[1] and wanted(weight)
        # The grad of the gathered input is partial per rank (each saw its own O/tp columns): summed over
        # tp and scattered back to this rank's sequence block in one reduce-scatter.
        gx_SBI = comm.reduce_scatter_dim0(g_SBO @ weight, ctx.axis) if want_x else None
        gw_OI = None
        if want_w:
            full_SBI = comm.all_gather_dim0(x_SBI, ctx.axis)  # the re-gather the saving costs
            # The weight grad needs every sequence position: this rank's O/tp rows see the whole sequence.
            gw_OI = g_SBO.flatten(0, -2).t() @ full_SBI.flatten(0, -2)
        gb_O = g_SBO.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] and want_w else None
        return gx_SBI, gw_OI, gb_O, None


# eager inside a torch.compile'd block, like the collectives in comm (see comm/autograd_ops.py: _eager)
_gathered_linear = eager(_GatheredLinear.apply)


class ColumnParallelLinear(nn.Module):
    """y_SBO/tp = x_SBI @ W[O/tp, I]^T; input copied to tp (or all-gathered over seq under sp, saving
    only the local block for backward: _GatheredLinear)."""

    def __init__(
        self, in_features: int, out_parts: Sequence[int], tp: Axis, sp: bool, bias: bool, device=None
    ):
        super().__init__()
        self.tp, self.sp = tp, sp
        out = sum(out_parts)
        self.weight = sharded_param(Shard((out, in_features), 0, tuple(out_parts), tp.rank, tp.size), device)
        self.bias = (
            sharded_param(Shard((out,), 0, tuple(out_parts), tp.rank, tp.size), device) if bias else None
        )
        self.gemm = None  # an Fp8Gemm under train.precision=fp8 (layers/fp8.py:enable_fp8)
        self.overlap_chunks = 0  # > 0: the sp all-gather chunked under the GEMM (layers/tp_overlap.py)

    def forward(self, x_SBI: torch.Tensor) -> torch.Tensor:
        if self.overlap_chunks and self.gemm is None:  # enable_tp_overlap sets it only under sp at tp > 1
            return tp_overlap.gather_matmul(x_SBI, self.weight, self.bias, self.tp, self.overlap_chunks)
        if self.gemm is not None:  # FP8: gather (autograd) then the scaled GEMM on the gathered input
            x_SBI = comm.gather_from_sp(x_SBI, self.tp) if self.sp else comm.copy_to_tp(x_SBI, self.tp)
            y_SBO = self.gemm(x_SBI, self.weight)
            return y_SBO if self.bias is None else y_SBO + self.bias
        if self.sp and self.tp.size > 1:
            return _gathered_linear(x_SBI, self.weight, self.bias, self.tp)
        return wgrad.linear(comm.copy_to_tp(x_SBI, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y_SBO = sum over tp of x_SBI/tp @ W[O, I/tp]^T; reduced
    over tp (or reduce-scattered over seq under sp)."""

    def __init__(self, in_features: int, out_features: int, tp: Axis, sp: bool, bias: bool, device=None):
        super().__init__()
        self.tp, self.sp = tp, sp
        self.weight = sharded_param(
            Shard((out_features, in_features), 1, (in_features,), tp.rank, tp.size), device
        )
        # The bias is added after the reduction, once; under sp each rank adds it to its own sequence block,
        # so its gradient is partial over tp.
        self.bias = sharded_param(Shard((out_features,)), device, tp_partial_grad=sp) if bias else None
        self.gemm = None  # an Fp8Gemm under train.precision=fp8 (layers/fp8.py:enable_fp8)
        self.overlap_chunks = 0  # > 0: the sp reduce-scatter chunked under the GEMM (layers/tp_overlap.py)

    def forward(self, x_SBI: torch.Tensor) -> torch.Tensor:
        if self.overlap_chunks and self.gemm is None:  # enable_tp_overlap sets it only under sp at tp > 1
            y_SBO = tp_overlap.matmul_scatter(x_SBI, self.weight, self.tp, self.overlap_chunks)
            return y_SBO if self.bias is None else y_SBO + self.bias
        # No bias in the matmul: added before the reduction it would be summed tp times.
        y_SBO = wgrad.linear(x_SBI, self.weight) if self.gemm is None else self.gemm(x_SBI, self.weight)
        y_SBO = comm.reduce_scatter_to_sp(y_SBO, self.tp) if self.sp else comm.reduce_from_tp(y_SBO, self.tp)
        return y_SBO if self.bias is None else y_SBO + self.bias
