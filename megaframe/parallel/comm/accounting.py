"""What every collective notes as it runs: the bytes this rank sends (the ring-algorithm volumes of
the package doc), its entry in the axis's CommStats ring buffer (op, group, shape, bytes), which the hang
watchdog dumps, and, for an async one, the Work that marks the entry done once waited for. A virtual
axis (the planner's) is counted and noted, and the call skipped."""

from __future__ import annotations

import torch

from megaframe.parallel import lanes
from megaframe.parallel.mesh import Axis
from megaframe.parallel.observe import mark


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def enter(axis: Axis, op: str, x: torch.Tensor, sent: float) -> dict | None:
    """Count the bytes sent, note the collective in the
    ring buffer; None on a virtual axis (skip the call)."""
    # Counted before the call, so a rank stuck inside the collective still shows it as its last entry.
    axis.stats.add(axis.name, sent, lanes.lane_of(axis))
    entry = axis.stats.record(op, axis.name, axis.ranks, x.shape, x.dtype, nbytes(x))
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


def done(axis: Axis, entry: dict, x: torch.Tensor, work=None):
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
