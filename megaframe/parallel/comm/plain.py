"""Plain collectives over one mesh axis (no autograd): in-place all-reduce, dim-0 and flat
all-gather and reduce-scatter (ZeRO's buckets, async), the all-to-alls of expert dispatch, the
whole-world flat gather."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megaframe.parallel.comm.accounting import done, enter, nbytes
from megaframe.parallel.lanes import group_of
from megaframe.parallel.mesh import Axis

# torch 2.13 renamed the flat collectives; keep working on the older names (torch >= 2.6 on GPU hosts).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place all-reduce over `axis`; returns x."""
    if axis.size == 1:
        return x
    if x.is_cuda and dist.get_backend(group_of(axis)) == "gloo":  # the mesh's world group (host decisions)
        host = all_reduce(x.cpu(), axis, op)
        return x.copy_(host)
    entry = enter(axis, "all_reduce", x, 2 * (axis.size - 1) / axis.size * nbytes(x))
    if entry is not None:
        done(axis, entry, x, dist.all_reduce(x, op=op, group=group_of(axis)))
    return x


def all_gather_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Concatenate every rank's x along dim 0, in axis-rank order."""
    if axis.size == 1:
        return x
    # The flat collective reads and writes raw storage: a strided view would gather the wrong elements.
    x = x.contiguous()
    out = torch.empty((axis.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    entry = enter(axis, "all_gather", x, (axis.size - 1) * nbytes(x))
    if entry is not None:
        done(axis, entry, x, _all_gather_flat(out, x, group=group_of(axis)))
    return out


def reduce_scatter_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum x over the axis and keep this rank's 1/n block of dim 0."""
    if axis.size == 1:
        return x
    x = x.contiguous()
    # Every rank must pass the same shape: an uneven split would make ranks disagree on the block sizes.
    assert x.shape[0] % axis.size == 0, f"dim 0 ({x.shape[0]}) not divisible by {axis.name}={axis.size}"
    out = torch.empty((x.shape[0] // axis.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    entry = enter(axis, "reduce_scatter", x, (axis.size - 1) / axis.size * nbytes(x))
    if entry is not None:
        done(axis, entry, x, _reduce_scatter_flat(out, x, group=group_of(axis)))
    return out


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, axis: Axis, async_op: bool = False):
    """Sum the flat x over `axis`; rank r keeps block r (of x.numel() / n elements) in `out`.

    `out` may be x's own block r (in place, as the ZeRO grad buckets do). With async_op the bytes are
    counted at launch and the Work is returned for the caller to wait on; None on an axis of size 1.
    """
    if axis.size == 1:
        # In place (out is x) is already the result; a copy_ onto itself would be wasted work.
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return None
    assert x.numel() == out.numel() * axis.size, (
        f"{x.numel()} elements do not split into {axis.size} x {out.numel()}"
    )
    entry = enter(axis, "reduce_scatter_flat", x, (axis.size - 1) / axis.size * nbytes(x))
    if entry is None:
        return None
    return done(axis, entry, x, _reduce_scatter_flat(out, x, group=group_of(axis), async_op=async_op))


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, axis: Axis, async_op: bool = False):
    """Concatenate every rank's flat x into `out` in axis-rank order; x may be out's own block (in place).

    Bytes counted at launch; returns the Work with async_op, None on an axis of size 1.
    """
    if axis.size == 1:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return None
    assert out.numel() == x.numel() * axis.size, f"{out.numel()} elements are not {axis.size} x {x.numel()}"
    entry = enter(axis, "all_gather_flat", x, (axis.size - 1) * nbytes(x))
    if entry is None:
        return None
    return done(axis, entry, x, _all_gather_flat(out, x, group=group_of(axis), async_op=async_op))


def split_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """This rank's 1/n block of dim 0 (no communication)."""
    if axis.size == 1:
        return x
    return x.chunk(axis.size, dim=0)[axis.rank].contiguous()


def all_to_all_counts(counts: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Even all-to-all of a flat tensor of axis.size equal blocks: block r goes to rank r (the per-expert
    token counts a dispatcher exchanges before the tokens themselves)."""
    if axis.size == 1:
        return counts
    # Even splits: every rank knows the sizes without a prior exchange (this IS the size exchange).
    counts = counts.contiguous()
    out = torch.empty_like(counts)
    entry = enter(axis, "all_to_all_counts", counts, (axis.size - 1) / axis.size * nbytes(counts))
    if entry is not None:
        done(axis, entry, counts, dist.all_to_all_single(out, counts, group=group_of(axis)))
    return out


def all_to_all_rows(x: torch.Tensor, axis: Axis, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows [sum(in_splits[:r]), +in_splits[r]) of x go to rank r; out holds rank r's rows to us at
    [sum(out_splits[:r]), +out_splits[r]). Bytes counted: the rows actually sent to other ranks."""
    if axis.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    row = x.element_size() * math.prod(x.shape[1:])
    # The rows this rank keeps for itself never leave it, so they are not counted as traffic.
    entry = enter(axis, "all_to_all", x, (sum(in_splits) - in_splits[axis.rank]) * row)
    if entry is not None:
        done(
            axis,
            entry,
            x,
            dist.all_to_all_single(
                out,
                x,
                output_split_sizes=list(out_splits),
                input_split_sizes=list(in_splits),
                group=group_of(axis),
            ),
        )
    return out


def all_gather_world(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Flat all-gather over a whole-world group (no Axis; the caller records it). Through the
    non-deprecated entry: torch 2.13 warns on all_gather_into_tensor, once per rank."""
    _all_gather_flat(out, x, group=group)
