"""Gradients of the replicated optimizer (optim.zero=0): every rank holds whole grads in `p.grad`,
all-reduced over the data-parallel axis in flat buckets. The steps around it are optim/finalize.py's.
"""
from __future__ import annotations

import torch
from torch import nn

from megaframe.optim.finalize import all_reduce_tensors, clip_, global_norm
from megaframe.parallel.mesh import Mesh
from megaframe.parallel.placement import Placement


class ReplicatedGrads:
    """finalize.GradSource over the model's `.grad`s: whole tensors, equal on every dp rank once reduced."""

    sharded = False

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.model, self.mesh = model, mesh

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def tied_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.placement.pp_tied]

    def reduce_data_parallel(self) -> None:
        params = self._params()
        # dense params over dp, experts over edp (the ranks holding the same experts): two groups, in
        # this fixed order on every rank
        for expert in (False, True):
            group = [p for p in params if p.placement.expert == expert]
            if group:
                all_reduce_tensors([p.grad for p in group], group[0].placement.data_axis(self.mesh))

    def final_grads(self) -> list[tuple[Placement, torch.Tensor]]:
        return [(p.placement, p.grad) for p in self._params()]


def grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """Global L2 norm of the model's (reduced) `.grad`s; see finalize.global_norm."""
    return global_norm(ReplicatedGrads(model, mesh).final_grads(), mesh, sharded=False)


def clip_grads(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale the model's `.grad`s by min(1, max_norm / norm), without a host sync."""
    clip_([g for _, g in ReplicatedGrads(model, mesh=None).final_grads()], norm, max_norm)
