"""RMSNorm and LayerNorm, sequence-parallel aware.

The weights are replicated over tp. Without sp every tp rank normalises the same full sequence and
gets identical gradients. Under sp each rank normalises its own sequence block, so the weight
gradients are partial: they are tagged `tp_partial_grad` and summed over tp before the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.layers.shard import Shard, sharded_param


class Norm(nn.Module):
    """kind='rmsnorm' (weight only) or 'layernorm' (weight and bias) over the last dim D."""

    def __init__(self, kind: str, dim: int, eps: float, sp: bool, device=None):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = sharded_param(Shard((dim,)), device, tp_partial_grad=sp)
        self.bias = sharded_param(Shard((dim,)), device, tp_partial_grad=sp) if kind == "layernorm" else None

    def forward(self, x_SBD: torch.Tensor) -> torch.Tensor:
        # Over the full hidden dim D, which tp never splits here: no collective needed for the statistics.
        if self.kind == "rmsnorm":
            return F.rms_norm(x_SBD, (x_SBD.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x_SBD, (x_SBD.shape[-1],), self.weight, self.bias, self.eps)
