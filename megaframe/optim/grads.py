"""Gradient reductions before the step: sequence-parallel partial grads over tp, data-parallel over dp,
then the global norm and clipping.

Grads are reduced in flat buckets (one collective per bucket, not one per tensor).
"""
from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis, Mesh

BUCKET_BYTES = 32 * 2**20


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    out, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += p.grad.numel() * p.grad.element_size()
        if size >= BUCKET_BYTES:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def all_reduce_grads(params: list[nn.Parameter], axis: Axis) -> None:
    """Sum the grads of `params` over `axis`, one flat all-reduce per bucket."""
    if axis.size == 1:
        return
    params = [p for p in params if p.grad is not None]
    for bucket in _buckets(params):
        grads = [p.grad for p in bucket]
        flat = comm.all_reduce(_flatten_dense_tensors(grads), axis)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def finalize_grads(model: nn.Module, mesh: Mesh) -> None:
    """Make every grad the full-batch gradient of this rank's slice.

    The loss is already divided by the global token count, so reductions are sums.
    Expert params (split over ep) are summed over edp, the ranks holding the same experts; the rest over dp.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    all_reduce_grads([p for p in params if getattr(p, "tp_partial_grad", False)], mesh.tp)
    all_reduce_grads([p for p in params if not p.shard.expert], mesh.dp)
    all_reduce_grads([p for p in params if p.shard.expert], mesh.edp)


def sync_tied_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum the tied embedding's grads between the first and last pipeline stage (both hold a copy)."""
    if mesh.pp_ends.size > 1 and model.cfg.tie_embeddings:
        main = getattr(model.embed.weight, "main_grad", None)
        if main is not None:  # ZeRO's fp32 grad-buffer slice (bf16 params have no .grad of their own)
            comm.all_reduce(main, mesh.pp_ends)
        else:
            all_reduce_grads([model.embed.weight], mesh.pp_ends)


def counts_in_norm(p: nn.Parameter, mesh: Mesh) -> bool:
    """Whether this rank's copy of p adds to the global grad norm, so each element counts once:
    tp-split slices on every tp rank, tp-replicated parameters on tp rank 0 only, and never a
    pipeline duplicate (a tied embedding's copy on the last stage is tagged `pp_duplicate`)."""
    return (p.shard.tp_split or mesh.tp.rank == 0) and not getattr(p, "pp_duplicate", False)


def grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """Global L2 norm of the gradient over tp and pp; dp replicas hold equal grads and are not added,
    but ep ranks hold different experts, whose squares are summed over ep."""
    sq = torch.zeros((), device=mesh.device, dtype=torch.float32)
    sq_experts = torch.zeros((), device=mesh.device, dtype=torch.float32)
    for p in model.parameters():
        if p.grad is not None and counts_in_norm(p, mesh):
            (sq_experts if p.shard.expert else sq).add_(p.grad.float().pow(2).sum())
    sq += comm.all_reduce(sq_experts, mesh.ep)
    comm.all_reduce(sq, mesh.tp)
    comm.all_reduce(sq, mesh.pp)
    return sq.sqrt()


def clip_grads(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads by min(1, max_norm / norm), without a host sync."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, scale)
