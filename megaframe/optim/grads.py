"""Gradients of the replicated optimizer (optim.zero=0): every rank holds whole grads in `p.grad`,
all-reduced over the data-parallel axis in flat buckets. The steps around it are optim/finalize.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from megaframe.optim.finalize import all_reduce_tensors, clip_, global_norm
from megaframe.parallel.mesh import Mesh
from megaframe.parallel.placement import Placement


def local_grads(model: nn.Module) -> list[tuple[Placement, torch.Tensor]]:
    """(placement, .grad) of every parameter that has a grad."""
    return [(p.placement, p.grad) for p in model.parameters() if p.grad is not None]


class ReplicatedGrads:
    """finalize.GradSource over the model's `.grad`s: whole tensors, equal on every dp rank once reduced."""

    sharded = False

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.model, self.mesh = model, mesh

    def tied_grads(self) -> list[torch.Tensor]:
        # Both pipeline ends list their copy in the same
        # (parameter) order, so the pp_ends all-reduce pairs them.
        return [g for pl, g in local_grads(self.model) if pl.pp_tied]

    def reduce_data_parallel(self) -> None:
        grads = local_grads(self.model)
        # dense grads over dp, experts over edp (the ranks holding the same experts): two groups, in
        # this fixed order on every rank
        for expert in (False, True):
            group = [(pl, g) for pl, g in grads if pl.expert == expert]
            if group:
                all_reduce_tensors([g for _, g in group], group[0][0].data_axis(self.mesh))

    def final_grads(self) -> list[tuple[Placement, torch.Tensor]]:
        return local_grads(self.model)


def grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """Global L2 norm of the model's (reduced) `.grad`s; see finalize.global_norm."""
    return global_norm(local_grads(model), mesh, sharded=False)


def clip_grads(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale the model's `.grad`s by min(1, max_norm / norm), without a host sync."""
    clip_([g for _, g in local_grads(model)], norm, max_norm)
