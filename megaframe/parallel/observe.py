"""What the training loop watches in every collective: how long this rank was held in it (each rank's
arrival, for the straggler figures) and, while a step is profiled, a named profiler range around it.

The mesh's CommStats carries one `Observer` (None: nothing watched, the planner's virtual meshes and the
unit tests). `comm/` calls `enter` as a collective starts and `leave` once this rank is released from it
(a blocking call returned, or an async one's Work was waited for).

Arrivals are compared through the time each rank is *held*: a collective over a group completes at one
moment for all its ranks (none can leave an all-reduce, all-gather or reduce-scatter before the last
one's data is in), so rank r's hold is `done - arrival_r` and `hold_max - hold_r` is how much later r
arrived than the earliest rank. Each hold is a difference of one process's own monotonic clock: no clock
is compared across processes or hosts, and no synchronisation is added. The last arriver is the rank
held least. On CUDA the host call only enqueues the collective, so the hold is measured on the stream
(CUDA events before and after; read at the log step, where the host already syncs).

Profiler ranges cost nothing when off: `named` and `action_range` hand back one shared null context, so a
step unprofiled creates no record_function and no closure (tests/unit/parallel/test_observe.py counts).
"""

from __future__ import annotations

import contextlib
import time

import torch

from megaframe.parallel import lanes

HOLDS_PER_WINDOW = 8192
"""At most this many holds per group between two log steps (the same first N on every rank of a group,
as they enter the group's collectives in the same order): a long log interval cannot grow the list."""

NULL = contextlib.nullcontext()
"""The one context handed out while nothing is profiled (no allocation per call)."""


class Observer:
    """This rank's watch over its collectives: `holds` per group and lane (axis name, ranks, lane) since the
    last `take`, and whether profiler ranges are named (`ranges`, set by the step profiler)."""

    def __init__(self, arrivals: bool = True):
        self.arrivals, self.ranges = arrivals, False
        self.holds: dict[tuple, list] = {}
        self.p2p: list = []
        self.ranges_opened = 0

    def enter(self, entry: dict, axis, x: torch.Tensor) -> None:
        """A collective over `axis` starts (its ring-buffer `entry` carries the watch to `leave`)."""
        if self.ranges:
            rf = torch.autograd.profiler.record_function(
                f"comm.{entry['op']}[{axis.name}] {entry['bytes']}B {list(entry['shape'])}"
            )
            rf.__enter__()
            self.ranges_opened += 1
            entry["range"] = rf
        if self.arrivals:
            entry["held_from"] = _mark(x.is_cuda)

    def launched(self, entry: dict) -> None:
        """An async collective was launched: its range covers the launch (its wait is timed by `held`)."""
        self._close_range(entry)
        entry.pop("held_from", None)

    def leave(self, entry: dict, axis, x: torch.Tensor) -> None:
        """This rank was released from the blocking collective `entry` (range closed, hold noted)."""
        self._close_range(entry)
        start = entry.pop("held_from", None)
        if start is not None:
            self._note(axis, start, _mark(x.is_cuda))

    @staticmethod
    def _close_range(entry: dict) -> None:
        rf = entry.pop("range", None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def held(self, axis, start, x: torch.Tensor) -> None:
        """An async collective's Work was waited for from `start` (`mark`) to now."""
        self._note(axis, start, _mark(x.is_cuda))

    def p2p_held(self, start, end) -> None:
        """This rank waited for a pipeline transfer from `start` to `end` (`mark`s)."""
        if len(self.p2p) < HOLDS_PER_WINDOW:
            self.p2p.append((start, end))

    def _note(self, axis, start, end) -> None:
        # a lane's own list: under the overlapped kinds the two lanes' collectives interleave differently on
        # each rank, while each lane enters its own in the same order on every rank (parallel/lanes.py)
        lane = lanes.lane_of(axis) or 0
        holds = self.holds.setdefault((axis.name, tuple(axis.ranks), lane), [])
        if len(holds) < HOLDS_PER_WINDOW:
            holds.append((start, end))

    def take(self) -> tuple[dict[tuple, list[float]], float]:
        """({(axis name, ranks): holds in seconds, in order}, seconds waited for pipeline transfers) since
        the last take (reads CUDA events: call it where the host already waits for the device)."""
        out, self.holds = self.holds, {}
        p2p, self.p2p = self.p2p, []
        merged: dict[tuple, list[float]] = {}
        for (name, ranks, _), v in sorted(out.items(), key=lambda kv: kv[0][2]):  # lane 0's, then lane 1's
            merged.setdefault((name, ranks), []).extend(_seconds(a, b) for a, b in v)
        return merged, sum(_seconds(a, b) for a, b in p2p)


def mark(on_device: bool):
    """A point in time for `held`: the host's monotonic clock, or an event on the stream on CUDA."""
    return _mark(on_device)


def _mark(on_device: bool):
    if on_device:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.monotonic()


def _seconds(a, b) -> float:
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def named(stats, name: str):
    """A profiler range called `name` while the mesh's observer names ranges, else the shared NULL."""
    obs = getattr(stats, "observer", None)
    if obs is None or not obs.ranges:
        return NULL
    obs.ranges_opened += 1
    return torch.autograd.profiler.record_function(name)


def p2p_range(axis, entry: dict):
    """The range of a pipeline batch's launch (its name built only while profiling)."""
    obs = getattr(axis.stats, "observer", None)
    if obs is None or not obs.ranges:
        return NULL
    obs.ranges_opened += 1
    return torch.autograd.profiler.record_function(f"comm.{entry['op']}[{axis.name}] {entry['bytes']}B")


ACTION_NAMES = {"F": "forward", "B": "backward", "W": "backward_weight"}


def action_range(stats, kind: str, microbatch: int, chunk: int, split: bool):
    """The range of one pipeline action: forward, backward (backward_input when W is apart) or
    backward_weight, of micro-batch `microbatch` and chunk `chunk`."""
    obs = getattr(stats, "observer", None)
    if obs is None or not obs.ranges:
        return NULL
    name = "backward_input" if kind == "B" and split else ACTION_NAMES[kind]
    obs.ranges_opened += 1
    return torch.autograd.profiler.record_function(f"{name} mb{microbatch} chunk{chunk}")
