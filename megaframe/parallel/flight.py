"""The collective flight records: the bytes each rank sent per group and the last collectives it entered
(a ring buffer the hang watchdog dumps), kept by every Axis and filled by parallel/comm/."""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

RECENT_COLLECTIVES = 64


@dataclass
class CommStats:
    """Bytes this rank sent per group, counted by the collectives in `comm` (ring-algorithm volumes),
    and the last collectives this rank entered (a ring buffer the hang watchdog dumps)."""

    sent: dict[str, int] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_COLLECTIVES))
    """dicts: op, group, ranks, shape, dtype, bytes, t (wall clock at entry), done (a blocking call
    returned, or an async one's Work was waited for), async (launched with async_op), event (device
    collectives: a CUDA event recorded once done, see `returned`)."""

    events: list = field(default_factory=list)
    """CUDA events, reused round-robin (one per ring-buffer slot), that tell whether a device
    collective's work has finished on its stream."""

    def returned(self, entry: dict, on_device: bool = False) -> None:
        """The host call of a collective returned (blocking) or its Work was waited for (async). On
        CUDA neither means it ran: NCCL only enqueued it on a stream. So for device tensors an event
        is recorded on the current stream (after the collective, or after the stream's wait on its
        Work); the watchdog's report queries it (completed vs enqueued). No host sync."""
        entry["done"] = True
        if on_device:
            # A fixed pool, not an event per collective: thousands of calls a step would each allocate one;
            # an event is only overwritten after RECENT_COLLECTIVES newer entries, when its entry left the
            # ring.
            if len(self.events) < RECENT_COLLECTIVES:
                self.events.append(torch.cuda.Event())
            event = self.events[self._next_event % RECENT_COLLECTIVES]
            self._next_event += 1
            event.record()
            entry["event"] = event

    _next_event: int = 0
    # parallel/observe.py's Observer: holds in collectives, profiler ranges
    observer: object = None

    # the overlapped pipeline kinds count from two threads (parallel/lanes.py): a read-add-write is not atomic
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    on_lane: list = field(default_factory=lambda: [0, 0])
    """Collectives entered on each lane over axes that have a twin (parallel/lanes.py; the overlapped
    pipeline kinds): both count where a forward and a backward ran at once."""

    def add(self, group: str, nbytes: float, lane: int | None = None) -> None:
        with self._lock:
            self.sent[group] = self.sent.get(group, 0) + int(nbytes)
            if lane is not None:
                self.on_lane[lane] += 1

    def record(self, op: str, group: str, ranks, shape, dtype, nbytes: int) -> dict:
        """Note a collective as it is entered; entry['done'] is set once a blocking call returns (see
        `noting`) or an async one's Work is waited for (comm/accounting.py: done)."""
        entry = {
            "op": op,
            "group": group,
            "ranks": tuple(ranks),
            "shape": tuple(shape),
            "dtype": str(dtype),
            "bytes": int(nbytes),
            "t": time.time(),
            "done": False,
            "async": False,
        }
        self.recent.append(entry)
        return entry

    @contextmanager
    def noting(self, op: str, group: str, ranks, shape, dtype, nbytes: int):
        """`with stats.noting(...):` around a blocking collective: recorded on entry, done on return."""
        entry = self.record(op, group, ranks, shape, dtype, nbytes)
        yield entry
        # Not in a finally: a collective that raised did not complete, and the dump should say so.
        entry["done"] = True

    def last(self, n: int = RECENT_COLLECTIVES) -> list[dict]:
        """The newest n entries, oldest first (safe to call from another thread)."""
        for _ in range(10):  # the main thread may append while we copy
            try:
                return list(self.recent)[-n:]
            except RuntimeError:
                continue
        return []

    def pop(self) -> dict[str, int]:
        # Swap, not clear: the caller keeps the dict it got while later collectives count into a new one.
        out, self.sent = self.sent, {}
        return out
