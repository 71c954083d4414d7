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

from megaframe.layers.shard import Shard, sharded_param
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


class ColumnParallelLinear(nn.Module):
    """y_SBO/tp = x_SBI @ W[O/tp, I]^T; input copied to tp (or all-gathered over seq under sp)."""

    def __init__(self, in_features: int, out_parts: Sequence[int], tp: Axis, sp: bool, bias: bool,
                 device=None):
        super().__init__()
        self.tp, self.sp = tp, sp
        out = sum(out_parts)
        self.weight = sharded_param(Shard((out, in_features), 0, tuple(out_parts), tp.rank, tp.size), device)
        self.bias = sharded_param(Shard((out,), 0, tuple(out_parts), tp.rank, tp.size), device) if bias else None

    def forward(self, x_SBI: torch.Tensor) -> torch.Tensor:
        x_SBI = comm.gather_from_sp(x_SBI, self.tp) if self.sp else comm.copy_to_tp(x_SBI, self.tp)
        return F.linear(x_SBI, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y_SBO = sum over tp of x_SBI/tp @ W[O, I/tp]^T; reduced over tp (or reduce-scattered over seq under sp)."""

    def __init__(self, in_features: int, out_features: int, tp: Axis, sp: bool, bias: bool, device=None):
        super().__init__()
        self.tp, self.sp = tp, sp
        self.weight = sharded_param(Shard((out_features, in_features), 1, (in_features,), tp.rank, tp.size), device)
        # The bias is added after the reduction, once; under sp each rank adds it to its own sequence block,
        # so its gradient is partial over tp.
        self.bias = sharded_param(Shard((out_features,)), device, tp_partial_grad=sp) if bias else None

    def forward(self, x_SBI: torch.Tensor) -> torch.Tensor:
        y_SBO = F.linear(x_SBI, self.weight)
        y_SBO = comm.reduce_scatter_to_sp(y_SBO, self.tp) if self.sp else comm.reduce_from_tp(y_SBO, self.tp)
        return y_SBO if self.bias is None else y_SBO + self.bias
