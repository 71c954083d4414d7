"""The one gradient-finalisation path of every optimizer stage: from the grads backward left on this
rank to the clipped full-batch grads the update reads, and the global norm.

    1. tied copies    sum the grads of pp_tied tensors (the tied embedding) over the pipeline ends
    2. data parallel  sum over dp (edp for experts): an all-reduce (zero=0) or the reduce-scatter of
                      ZeRO's buckets (zero=1, mostly launched during backward), waited for here
    3. tp partials    sum over tp the grads each tp rank saw part of (sequence-parallel norms, biases)
    4. norm           each element once: `Placement.counts_in_norm` drops tp copies and pipeline
                      duplicates; squares are summed over the data-parallel axis where ranks hold
                      different elements (ZeRO's owned ranges; experts over ep)
    5. clip           scale by min(1, max_norm / norm) on the device (the optimizers hand it to fused
                      AdamW as grad_scale instead: clip_divisor, no separate pass over the grads)

The stage supplies a `GradSource`: which grads are tied, how it reduces over data parallel, and this
rank's final grads with their placements. Every step above reads only the placements, so zero=0 and
zero=1 (and later stages) agree on what is summed where. The loss is already divided by the global
token count, so every reduction is a sum.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis, Mesh
from megaframe.parallel.placement import Placement

BUCKET_BYTES = 32 * 2**20


class GradSource(Protocol):
    """What an optimizer stage hands to `finalize`."""

    sharded: bool
    """After `reduce_data_parallel`, ranks of the data-parallel axis hold disjoint parts of the grads
    (ZeRO), so their squares are summed over dp; else they hold equal copies."""

    def tied_grads(self) -> list[torch.Tensor]:
        """This rank's whole grads of pp_tied tensors, not yet reduced over data parallel."""

    def reduce_data_parallel(self) -> None:
        """Sum over each tensor's data axis (Placement.data_axis); returns once the sums have landed."""

    def final_grads(self) -> list[tuple[Placement, torch.Tensor]]:
        """The grads the update reads (whole tensors, or ZeRO's owned ranges), with their placements."""


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    # Bounded buckets: one flat copy of all grads would double their memory; one call per tensor would
    # pay the collective's latency hundreds of times. Ranks build the same buckets from the same list.
    out, cur, size = [], [], 0
    for t in tensors:
        cur.append(t)
        size += t.numel() * t.element_size()
        if size >= BUCKET_BYTES:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def all_reduce_tensors(tensors: list[torch.Tensor], axis: Axis) -> None:
    """Sum `tensors` in place over `axis`, one flat all-reduce per bucket (not one per tensor)."""
    if axis.size == 1 or not tensors:
        return
    for bucket in _buckets(tensors):
        flat = comm.all_reduce(_flatten_dense_tensors(bucket), axis)
        torch._foreach_copy_(bucket, list(_unflatten_dense_tensors(flat, bucket)))


def _sum_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    # one norm per tensor (a fused kernel), squared and summed: no flat copy of the grads; fp32 norms of bf16
    # grads (optim.step_kernel=compiled reads bf16-reduced grads as they are, 2 B an element)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def global_norm(grads: list[tuple[Placement, torch.Tensor]], mesh: Mesh, sharded: bool) -> torch.Tensor:
    """L2 norm of the whole model's gradient, the same on every rank.

    Squares are grouped by the data-parallel axis over which ranks hold different elements: ZeRO's
    owned ranges are disjoint over dp (cp·dp under cp; experts: over edp, and ep ranks hold different
    experts, so cp·dp = ep x edp covers both; under HSDP over the shard group dp_shard, whose replicas
    hold equal shards); replicated grads differ only between ep ranks, for experts. Every group is
    reduced even when empty on this rank, so all ranks enter the same collectives. Experts folded over
    tp (ep·etp > 1) take their own path: `_folded_norm_sq`."""
    if mesh.experts_folded:
        return _folded_norm_sq(grads, mesh, sharded).sqrt()
    groups: dict[str, tuple[Axis | None, list[torch.Tensor]]] = (
        {"dp": (mesh.dp_shard, [])} if sharded else {"dense": (None, []), "expert": (mesh.ep, [])}
    )
    for pl, g in grads:
        if pl.counts_in_norm(mesh):
            groups["dp" if sharded else "expert" if pl.expert else "dense"][1].append(g)
    # fp32 accumulator: bf16 partial sums of squares would lose the small layers' contribution.
    sq = torch.zeros((), dtype=torch.float32, device=mesh.device)
    # Dict order is fixed by construction, so every rank issues these all-reduces in the same order.
    for axis, tensors in groups.values():
        part = _sum_squares(tensors, mesh.device)
        sq += part if axis is None else comm.all_reduce(part, axis)
    # tp ranks hold different slices (or a copy counted on tp rank 0 only), pp ranks different layers
    comm.all_reduce(sq, mesh.tp)
    comm.all_reduce(sq, mesh.pp)
    return sq.sqrt()


def _folded_norm_sq(grads: list[tuple[Placement, torch.Tensor]], mesh: Mesh, sharded: bool) -> torch.Tensor:
    """The squared norm when experts are folded over tp·cp·dp: their elements differ over ep and etp (and
    ZeRO's ranges over the expert shard group), never copies over tp, so their squares are summed over
    those axes and not over tp; the dense ones as before (shard group, then tp); both over pp."""
    dense = [g for pl, g in grads if not pl.expert and pl.counts_in_norm(mesh)]
    expert = [g for pl, g in grads if pl.expert and pl.counts_in_norm(mesh)]
    sq_dense, sq_expert = _sum_squares(dense, mesh.device), _sum_squares(expert, mesh.device)
    # the same collectives in the same order on every rank, empty or not
    axes_dense = ((mesh.dp_shard,) if sharded else ()) + (mesh.tp,)
    axes_expert = ((mesh.edp_shard,) if sharded else ()) + (mesh.ep, mesh.etp)
    for axis in axes_dense:
        sq_dense = comm.all_reduce(sq_dense, axis)
    for axis in axes_expert:
        sq_expert = comm.all_reduce(sq_expert, axis)
    return comm.all_reduce(sq_dense + sq_expert, mesh.pp)


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads by min(1, max_norm / norm) on the device, without a host sync (eps: a zero norm)."""
    if max_norm <= 0 or not grads:
        return
    # A tensor scale, not `if norm > max_norm`: a Python branch would sync the host on the norm every step.
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, scale)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """Step 5 for a fused AdamW: its `grad_scale`, max(1, norm / max_norm), which the kernel divides each grad
    by as it reads it (and writes the clipped grad back) instead of a separate pass over the grads (clip_
    reads and writes 8 B per fp32 grad). None when clipping is off. On the device, no host sync."""
    if max_norm <= 0:
        return None
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


def finalize(source: GradSource, mesh: Mesh, max_norm: float, clip: bool = True) -> torch.Tensor:
    """Steps 1-5 of the module docstring (clip=False: step 5 is the caller's, clip_divisor); returns the
    global norm before clipping."""
    # The tied sum must precede the data-parallel reduction: ZeRO's reduce-scatter leaves each rank only
    # its range, and both copies' ranges must hold the sum of the two stages' grads.
    all_reduce_tensors(source.tied_grads(), mesh.pp_ends)
    source.reduce_data_parallel()
    grads = source.final_grads()
    # tp peers share the buffer layout, so under ZeRO their owned ranges hold the same elements
    all_reduce_tensors([g for pl, g in grads if pl.tp_partial_grad], mesh.tp)
    norm = global_norm(grads, mesh, source.sharded)
    if clip:
        clip_([g for _, g in grads], norm, max_norm)
    return norm
