"""Collectives over one mesh axis, plain and autograd-aware, each counting the bytes this rank sends.

Byte counts are the ring-algorithm volumes for n ranks and a tensor of b bytes:
all-reduce 2(n-1)/n·b, all-gather (n-1)·b_in, reduce-scatter (n-1)/n·b_in, all-to-all (n-1)/n·b.
An axis of size 1 never communicates, so every function is the identity there. A virtual axis (the
planner's, no process group) counts and returns tensors of the right shape without communicating.
Every collective is also noted in the axis's CommStats ring buffer as it is entered (op, group,
shape, bytes), which the hang watchdog dumps: the last entries name the collective a rank is stuck in.

Activations are sequence-first ([S, B, D]), so sequence-parallel splits and gathers are along dim 0,
which is contiguous and maps straight onto all_gather / reduce_scatter of flat tensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Axis
from megaframe.parallel.observe import mark, p2p_range

# torch 2.13 renamed the flat collectives; keep working on the older names (torch >= 2.6 on GPU hosts).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _enter(axis: Axis, op: str, x: torch.Tensor, sent: float) -> dict | None:
    """Count the bytes sent, note the collective in the
    ring buffer; None on a virtual axis (skip the call)."""
    # Counted before the call, so a rank stuck inside the collective still shows it as its last entry.
    axis.stats.add(axis.name, sent)
    entry = axis.stats.record(op, axis.name, axis.ranks, x.shape, x.dtype, _nbytes(x))
    if axis.virtual:
        return None
    if axis.stats.observer is not None:  # the arrival clock starts after the bookkeeping above
        axis.stats.observer.enter(entry, axis, x)
    return entry


class _TrackedWork:
    """An async collective's Work that marks its ring-buffer entry done once waited for."""

    def __init__(self, work, entry: dict, axis: Axis, x: torch.Tensor):
        self.work, self.entry, self.axis, self.x, self.on_device = work, entry, axis, x, x.is_cuda

    def wait(self, *args, **kwargs):
        obs = self.axis.stats.observer
        start = mark(self.x.is_cuda) if obs is not None and obs.arrivals else None
        out = self.work.wait(*args, **kwargs)
        # Marked after the wait, not at launch: a hang inside the wait must leave the entry open.
        self.axis.stats.returned(self.entry, self.on_device)
        if start is not None:  # an async collective holds a rank in its wait: the hold its arrival shows
            obs.held(self.axis, start, self.x)
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


def _done(axis: Axis, entry: dict, x: torch.Tensor, work=None):
    """Mark a blocking collective as returned; an async one as launched, done when its Work is waited
    for. On CUDA "returned" is only "enqueued": CommStats.returned records an event the watchdog checks."""
    obs = axis.stats.observer
    if work is None:
        axis.stats.returned(entry, x.is_cuda)
        if obs is not None:
            obs.leave(entry, axis, x)
        return None
    entry["async"] = True
    if obs is not None:
        obs.launched(entry)
    return _TrackedWork(work, entry, axis, x)


def all_reduce(x: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place all-reduce over `axis`; returns x."""
    if axis.size == 1:
        return x
    if x.is_cuda and dist.get_backend(axis.group) == "gloo":  # the mesh's world group (host decisions)
        host = all_reduce(x.cpu(), axis, op)
        return x.copy_(host)
    entry = _enter(axis, "all_reduce", x, 2 * (axis.size - 1) / axis.size * _nbytes(x))
    if entry is not None:
        _done(axis, entry, x, dist.all_reduce(x, op=op, group=axis.group))
    return x


def broadcast(x: torch.Tensor, axis: Axis, src: int) -> torch.Tensor:
    """In place: x of the axis's rank `src` (its coordinate on the axis) on every rank; returns x."""
    if axis.size == 1:
        return x
    entry = _enter(axis, "broadcast", x, _nbytes(x) if axis.rank == src else 0)
    if entry is not None:
        _done(axis, entry, x, dist.broadcast(x, src=axis.ranks[src], group=axis.group))
    return x


def all_gather_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Concatenate every rank's x along dim 0, in axis-rank order."""
    if axis.size == 1:
        return x
    # The flat collective reads and writes raw storage: a strided view would gather the wrong elements.
    x = x.contiguous()
    out = torch.empty((axis.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    entry = _enter(axis, "all_gather", x, (axis.size - 1) * _nbytes(x))
    if entry is not None:
        _done(axis, entry, x, _all_gather_flat(out, x, group=axis.group))
    return out


def reduce_scatter_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum x over the axis and keep this rank's 1/n block of dim 0."""
    if axis.size == 1:
        return x
    x = x.contiguous()
    # Every rank must pass the same shape: an uneven split would make ranks disagree on the block sizes.
    assert x.shape[0] % axis.size == 0, f"dim 0 ({x.shape[0]}) not divisible by {axis.name}={axis.size}"
    out = torch.empty((x.shape[0] // axis.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    entry = _enter(axis, "reduce_scatter", x, (axis.size - 1) / axis.size * _nbytes(x))
    if entry is not None:
        _done(axis, entry, x, _reduce_scatter_flat(out, x, group=axis.group))
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
    entry = _enter(axis, "reduce_scatter_flat", x, (axis.size - 1) / axis.size * _nbytes(x))
    if entry is None:
        return None
    return _done(axis, entry, x, _reduce_scatter_flat(out, x, group=axis.group, async_op=async_op))


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, axis: Axis, async_op: bool = False):
    """Concatenate every rank's flat x into `out` in axis-rank order; x may be out's own block (in place).

    Bytes counted at launch; returns the Work with async_op, None on an axis of size 1.
    """
    if axis.size == 1:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return None
    assert out.numel() == x.numel() * axis.size, f"{out.numel()} elements are not {axis.size} x {x.numel()}"
    entry = _enter(axis, "all_gather_flat", x, (axis.size - 1) * _nbytes(x))
    if entry is None:
        return None
    return _done(axis, entry, x, _all_gather_flat(out, x, group=axis.group, async_op=async_op))


def split_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """This rank's 1/n block of dim 0 (no communication)."""
    if axis.size == 1:
        return x
    return x.chunk(axis.size, dim=0)[axis.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """forward: identity (input replicated on tp); backward: all-reduce grads over tp."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, g):
        # Each tp rank's downstream consumes x through its own weight shard, so x's grad is the sum of them.
        return all_reduce(g.contiguous(), ctx.axis), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce partial sums over tp; backward: identity."""

    @staticmethod
    def forward(ctx, x, axis):
        # all_reduce works in place: the clone leaves the caller's x (which autograd may hold) unmodified.
        return all_reduce(x.contiguous().clone() if axis.size > 1 else x, axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToSP(torch.autograd.Function):
    """forward: keep this rank's sequence block (dim 0); backward: all-gather the seq dim."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return split_dim0(x, axis)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.axis), None


class _GatherFromSP(torch.autograd.Function):
    """forward: all-gather the seq dim; backward: reduce-scatter of the grads. sp: before a column-parallel
    layer; cp: K and V (every rank's queries attended to every rank's K/V, so each block's grad is a sum)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return all_gather_dim0(x, axis)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g, ctx.axis), None


class _ReduceScatterToSP(torch.autograd.Function):
    """forward: reduce-scatter partial sums over the seq dim
    (after a row-parallel layer); backward: all-gather."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return reduce_scatter_dim0(x, axis)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.axis), None


# The collectives run eagerly even inside a torch.compile'd block (train.compile): dynamo would guard
# on the byte counters and recompile every step. At size 1 they are the identity and compile away.
_eager = {
    f: eager(f.apply) for f in (_CopyToTP, _ReduceFromTP, _ScatterToSP, _GatherFromSP, _ReduceScatterToSP)
}


def gather_from_cp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """K or V of the whole cp group (context parallelism, cp_comm=allgather); bytes count as cp."""
    return _eager[_GatherFromSP](x, axis) if axis.size > 1 else x  # the sp gather's op, over cp


def copy_to_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_CopyToTP](x, axis)


def reduce_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_ReduceFromTP](x, axis)


def scatter_to_sp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_ScatterToSP](x, axis)


def gather_from_sp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_GatherFromSP](x, axis)


def reduce_scatter_to_sp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _eager[_ReduceScatterToSP](x, axis)


def all_to_all_counts(counts: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Even all-to-all of a flat tensor of axis.size equal blocks: block r goes to rank r (the per-expert
    token counts a dispatcher exchanges before the tokens themselves)."""
    if axis.size == 1:
        return counts
    # Even splits: every rank knows the sizes without a prior exchange (this IS the size exchange).
    counts = counts.contiguous()
    out = torch.empty_like(counts)
    entry = _enter(axis, "all_to_all_counts", counts, (axis.size - 1) / axis.size * _nbytes(counts))
    if entry is not None:
        _done(axis, entry, counts, dist.all_to_all_single(out, counts, group=axis.group))
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
    entry = _enter(axis, "all_to_all", x, (sum(in_splits) - in_splits[axis.rank]) * row)
    if entry is not None:
        _done(
            axis,
            entry,
            x,
            dist.all_to_all_single(
                out,
                x,
                output_split_sizes=list(out_splits),
                input_split_sizes=list(in_splits),
                group=axis.group,
            ),
        )
    return out


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with splits s; backward: all-to-all with the reversed splits.

    s = (out_splits, in_splits) as in `all_to_all_rows`; the gradient of the rows we received goes back
    to the ranks that sent them (out and in swapped), so the pair is its own adjoint."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.splits = axis, (out_splits, in_splits)
        return all_to_all_rows(x, axis, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(g, ctx.axis, in_splits, out_splits), None, None, None


def all_to_all(x: torch.Tensor, axis: Axis, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Autograd-aware uneven all-to-all of rows over `axis` (expert-parallel token dispatch)."""
    return x if axis.size == 1 else _AllToAll.apply(x, axis, list(out_splits), list(in_splits))


def broadcast_object(obj, mesh=None):
    """Broadcast a picklable object from the job's first rank to all of its ranks (start-up, resume and
    checkpoint decisions, never in a step). With `mesh`, over the mesh's world group: a job may run on a
    subset of the processes (the test pool), and only its ranks take part."""
    # Every rank of the job must reach this call (it blocks until all do); one process needs no exchange.
    if not dist.is_initialized() or dist.get_world_size() == 1 or (mesh is not None and mesh.world == 1):
        return obj
    box = [obj]
    if mesh is None:
        dist.broadcast_object_list(box, src=0)
    else:
        # group_src is the rank within the job's group: with the test pool, global rank 0 may not be in it.
        dist.broadcast_object_list(box, group=mesh.group, group_src=0)
    return box[0]


def all_gather_world(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Flat all-gather over a whole-world group (no Axis; the caller records it). Through the
    non-deprecated entry: torch 2.13 warns on all_gather_into_tensor, once per rank."""
    _all_gather_flat(out, x, group=group)


class _BatchWork:
    """One Work of a p2p batch, tracked: the batch's ring-buffer entry is done once all are waited for,
    through CommStats.returned like every collective (on CUDA it records the event the watchdog queries:
    a batch NCCL still runs reads "ENQUEUED, NOT COMPLETED", not "returned"). Waiting again returns at
    once."""

    def __init__(self, work, entry: dict, pending: list, stats, on_device: bool):
        self.work, self.entry, self.pending, self.waited = work, entry, pending, False
        self.stats, self.on_device = stats, on_device

    def wait(self, *args, **kwargs):
        if self.waited:  # a gloo Work waited twice waits for a second transfer that never comes
            return True
        obs = self.stats.observer  # a rank held here waits for its pipeline peer (runops/arrivals.py)
        start = mark(self.on_device) if obs is not None and obs.arrivals else None
        out = self.work.wait(*args, **kwargs)
        if start is not None:
            obs.p2p_held(start, mark(self.on_device))
        self.waited = True
        self.pending[0] -= 1
        if self.pending[0] == 0:
            self.stats.returned(self.entry, self.on_device)
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


def batch_isend_irecv(
    axis: Axis, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
) -> list:
    """Send and receive (tensor, peer rank on `axis`) pairs as one batch; returns what the backend returns.

    That is one Work per op on gloo but ONE coalesced Work for the whole batch on NCCL (and under the
    emulated NCCL semantics the axis may carry, parallel/p2p_semantics.py): a caller must wait on every
    Work returned, never pick out the receives' Works by position. Bytes sent count as `axis` traffic.
    """
    for t, _ in sends:
        axis.stats.add(axis.name, _nbytes(t))
    if axis.virtual:  # the planner's axis: counted, nothing to move (the receive buffers keep their shapes)
        return []
    # An empty batch must not reach torch: dist.batch_isend_irecv reads op 0's group and raises on [].
    if not sends and not recvs:
        return []
    first = (sends or recvs)[0][0]
    entry = axis.stats.record(
        f"p2p send{[p for _, p in sends]} recv{[p for _, p in recvs]}",
        axis.name,
        axis.ranks,
        first.shape,
        first.dtype,
        sum(_nbytes(t) for t, _ in sends + recvs),
    )
    entry["async"] = True
    # P2POp takes global ranks even with a group; axis ranks are positions within the axis.
    sends_g = [(t, axis.ranks[p]) for t, p in sends]
    recvs_g = [(t, axis.ranks[p]) for t, p in recvs]
    with p2p_range(axis, entry):  # a profiler range while profiled; a shared null context otherwise
        if axis.p2p is not None:
            works = [axis.p2p.submit(sends_g, recvs_g)]
        else:
            ops = [dist.P2POp(dist.isend, t, peer, group=axis.group) for t, peer in sends_g]
            ops += [dist.P2POp(dist.irecv, t, peer, group=axis.group) for t, peer in recvs_g]
            works = dist.batch_isend_irecv(ops)
    # Shared counter (a list, so every _BatchWork sees one cell): the entry is done when the last Work is.
    pending = [len(works)]
    on_device = first.is_cuda and axis.p2p is None  # the NCCL emulation is gloo (host) only
    return [_BatchWork(w, entry, pending, axis.stats, on_device) for w in works]


def gather_objects(obj, group) -> list:
    """Every rank's picklable `obj`, in rank order, over the whole-mesh `group` (None: one process).
    Used where ranks must agree on an outcome (a checkpoint commit, a load), never in a step."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
