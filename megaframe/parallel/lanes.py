"""Two lanes of communicators, so a forward and a backward of different micro-batches can run at once
(the overlapped pipeline kinds, pipeline/schedule.py: ScheduleSpec.overlap).

Collectives on one communicator must be entered in the same order on every rank of its group. A forward
and a backward that run concurrently on two threads would enter theirs in an order that differs from rank
to rank, so each runs on its own lane: the axes a chunk's compute uses (tp, cp, ep, etp, ep_node, ep_rail)
hold a second communicator over the same ranks (`Axis.twin`), and a collective runs on the twin while its
thread is on lane 1. The executor gives each micro-batch one lane for its forward and its backward, the
other lane than the backward it runs beside (pipeline/executor.py), so the two threads never share a
communicator, and every rank of a group, running the same schedule, uses the same lane for the same work.

The lane is the thread's (`use`), as torch's grad mode is. Backward ops on CUDA run on the autograd engine's
device thread, not the thread that called backward, so the chunk's output carries a mark (`mark`: a hook on
its grad) that sets that thread's lane before any other node of the chunk's backward runs.

Legend: none (no shaped tensors here).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch

LANED = ("tp", "cp", "ep", "etp", "ep_node", "ep_rail")
"""The grid axes whose groups get a twin: every axis a forward or backward of a chunk communicates over.
The data-parallel family's collectives (grad reduce-scatters, ZeRO gathers) run in hooks of the backward
only, between steps, or are refused with the overlapped kinds (ZeRO-3; config/checks.py)."""

_local = threading.local()


def current() -> int:
    """This thread's lane (0 unless set by `use` or a chunk's `mark` in backward)."""
    return getattr(_local, "lane", 0)


@contextmanager
def use(lane: int):
    """Run the block's collectives on `lane` (this thread only)."""
    before = current()
    _local.lane = lane
    try:
        yield
    finally:
        _local.lane = before


def group_of(axis):
    """The process group a collective over `axis` runs on from this thread: the axis's own on lane 0,
    its twin on lane 1 (the axis's own where it has none: an axis no chunk's compute uses, or of size 1)."""
    twin = axis.twin
    return twin if twin is not None and current() == 1 else axis.group


def lane_of(axis) -> int | None:
    """This thread's lane for a collective over `axis`, as its counts and holds are kept apart: None where
    the axis has no twin (its collectives have one order whatever the thread)."""
    return current() if axis.twin is not None else None


def _set_lane(lane: int, grad: torch.Tensor) -> None:
    # the first hook of the chunk's backward: every collective after it on this thread is the chunk's
    _local.lane = lane


def mark(x: torch.Tensor, lane: int) -> torch.Tensor:
    """x, whose backward runs on `lane` from here on (on whichever thread autograd runs it): a hook on its
    grad, which runs before any other node of the chunk's backward. A hook, not an identity op: the output
    stays the tensor it was, so the executor's release of a sent output frees its storage (a view would
    keep it alive through its base)."""
    if x.requires_grad:
        x.register_hook(functools.partial(_set_lane, lane))
    return x


_side: dict = {}  # device -> lane 1's CUDA stream, made once


@contextmanager
def on_stream(lane: int, device: torch.device):
    """Lane 1's work on its own CUDA stream, so the device runs it beside lane 0's (its backward later runs
    there too: autograd runs a node's backward on its forward's stream). The stream waits for what came
    before, and the default stream for what it did. Nothing to do on a CPU, or on lane 0."""
    if device.type != "cuda" or lane == 0:
        yield
        return
    side = _side.get(device)
    if side is None:  # made once: a stream per pair would cost its creation each time
        side = _side[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)
