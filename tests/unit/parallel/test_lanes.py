"""The lane a collective runs on (parallel/lanes.py): the thread's own, set around a forward or a backward
and, for a chunk's backward, by the mark on its output, on whichever thread autograd runs it."""

from __future__ import annotations

import sys
import threading

import torch

from megaframe.parallel import lanes
from megaframe.parallel.flight import CommStats
from megaframe.parallel.mesh import Axis

ONE, TWIN = object(), object()  # stand-ins for two process groups over the same ranks


def _axis(twin=TWIN) -> Axis:
    return Axis("ep", 2, 0, (0, 1), ONE, CommStats(), twin=twin)


def test_a_thread_on_lane_one_uses_the_twin_and_other_threads_are_untouched():
    ax, seen = _axis(), {}
    with lanes.use(1):
        seen["here"] = lanes.group_of(ax)
        t = threading.Thread(target=lambda: seen.update(other=lanes.group_of(ax)))
        t.start()
        t.join()
    assert seen == {"here": TWIN, "other": ONE}
    assert lanes.group_of(ax) is ONE and lanes.current() == 0
    # an axis without a twin (the data-parallel family, or any axis off the overlapped kinds) keeps its group
    with lanes.use(1):
        assert lanes.group_of(_axis(twin=None)) is ONE


def test_the_mark_sets_the_lane_of_the_thread_that_runs_the_backward():
    x = torch.ones(3, requires_grad=True)
    with lanes.use(1):
        y = lanes.mark(x * 2, 1)
    seen = []

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(lanes.current())  # runs after the mark's backward: the chunk's lane
            return g

    out = _Probe.apply(x) * 3
    z = lanes.mark(out, 1)
    # the output itself, not a view of it: the executor's release of a sent output must free its storage
    assert z is out and z._base is None
    assert lanes.current() == 0
    worker = threading.Thread(target=lambda: (z.sum() + y.sum()).backward())
    worker.start()
    worker.join()
    assert seen == [1] and x.grad.tolist() == [5.0, 5.0, 5.0]
    assert lanes.current() == 0  # this thread's lane is its own


def test_bytes_are_counted_per_lane_from_two_threads():
    """Two threads adding at once lose no count (the interpreter switches threads every microsecond here,
    so an unlocked read-add-write loses some)."""
    stats, interval = CommStats(), sys.getswitchinterval()

    def add(lane: int) -> None:
        for _ in range(100_000):
            stats.add("ep", 1, lane)

    threads = [threading.Thread(target=add, args=(lane,)) for lane in (0, 1)]
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert stats.sent == {"ep": 200_000} and stats.on_lane == [100_000, 100_000]


def test_each_lane_keeps_its_own_holds_and_the_window_lists_lane_0_then_lane_1():
    """The straggler figures pair the k-th hold of a group across its ranks: under two lanes the lanes'
    collectives interleave differently on each rank, so each lane keeps its own list (each in the group's
    order on every rank) and the window gives lane 0's, then lane 1's."""
    from megaframe.parallel.observe import Observer

    obs, ax = Observer(), _axis()
    with lanes.use(1):
        obs._note(ax, 10.0, 10.5)
    obs._note(ax, 0.0, 0.1)
    with lanes.use(1):
        obs._note(ax, 11.0, 11.7)
    holds, _ = obs.take()
    assert list(holds) == [("ep", (0, 1))]
    assert [round(h, 6) for h in holds[("ep", (0, 1))]] == [0.1, 0.5, 0.7]


def test_the_compute_window_counts_a_pairs_shared_time_once():
    from megaframe.runops.straggler import busy_seconds

    spans = [("F", 0.0, 2.0), ("B", 1.0, 3.0), ("F", 5.0, 6.0), ("B", 5.5, 5.7)]
    assert busy_seconds(spans) == 4.0 and busy_seconds([]) == 0.0
