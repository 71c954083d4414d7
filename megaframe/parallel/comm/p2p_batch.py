"""Point-to-point transfers as one batch (the pipeline's sends and receives), tracked like every
collective: counted, noted, their entry done once every Work of the batch is waited for."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaframe.parallel import lanes
from megaframe.parallel.comm.accounting import nbytes
from megaframe.parallel.mesh import Axis
from megaframe.parallel.observe import mark, p2p_range


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
        axis.stats.add(axis.name, nbytes(t), lanes.lane_of(axis))
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
        sum(nbytes(t) for t, _ in sends + recvs),
    )
    entry["async"] = True
    # P2POp takes global ranks even with a group; axis ranks are positions within the axis.
    sends_g = [(t, axis.ranks[p]) for t, p in sends]
    recvs_g = [(t, axis.ranks[p]) for t, p in recvs]
    with p2p_range(axis, entry):  # a profiler range while profiled; a shared null context otherwise
        if axis.p2p is not None:
            works = [axis.p2p.submit(sends_g, recvs_g)]
        else:
            group = lanes.group_of(axis)
            ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, peer in sends_g]
            ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t, peer in recvs_g]
            works = dist.batch_isend_irecv(ops)
    # Shared counter (a list, so every _BatchWork sees one cell): the entry is done when the last Work is.
    pending = [len(works)]
    on_device = first.is_cuda and axis.p2p is None  # the NCCL emulation is gloo (host) only
    return [_BatchWork(w, entry, pending, axis.stats, on_device) for w in works]
