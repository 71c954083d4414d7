"""Run every rank's action list together, without processes, and check the schedule.

The ranks issue their communication in batches exactly as the executor does (consecutive
communication actions are one batch, waited for right before the first compute that reads one of its
receives, and every batch by the end), under one of two send models:
- BUFFERED (gloo): every op of a batch is posted when issued; a send completes at once; a receive
  when its message has been sent.
- RENDEZVOUS (NCCL, DESIGN §1.3c): a rank's batches on its one communicator run in order, a batch's
  ops are posted only once the batch before it completed, a send completes only once the peer has
  posted the matching receive and a receive once the matching send is posted.
Messages between two ranks match in posting order, one FIFO per (sender, receiver) whatever the
direction (NCCL has no tags): the n-th send from r to q is the n-th receive by q from r, and it must
carry what that receive expects (direction, micro-batch, the neighbouring stage). A rank posts in its
program order under both models, so which op meets which is known before any time passes: the messages
are checked up front and the replay only times them.

Time model: F, B and W take their `Costs` (default: F = 1, B = `backward_time`, no W; the zero-bubble
kinds B = W = 1), transfers none. The compute orders stay the unit-time ones that pair the batches
(schedule.py); the replay times them with the costs. Checks: matching, no deadlock, each
(microbatch, chunk) forwarded before it is backwarded, every F and B (and W) exactly once, in-flight
activations within the schedule's bound. Reports the bubble two ways: idle time (the makespan less a
rank's compute: equal on every rank, all do the same work) and idle / makespan.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
from dataclasses import dataclass, field

from megaframe.pipeline.grouping import build_schedule
from megaframe.pipeline.schedule import (
    COMPUTE,
    SCHEDULES,
    Action,
    B,
    F,
    Grouping,
    W,
    activation_bound,
)
from megaframe.pipeline.sim_graph import ScheduleError, ScheduleGraph, graph_memory

W_FRACTION = 0.5
"""Default share of a micro-batch chunk's saved activations that a pending W keeps (the weighted layers'
inputs and output grads); planning.memory.activations.w_fraction measures it for a model."""


class SendModel(enum.Enum):
    BUFFERED = "buffered"
    RENDEZVOUS = "rendezvous"


@dataclass(frozen=True)
class Costs:
    """Time of one chunk's F, B (input gradient) and W (weight gradients) of one micro-batch. A kind that
    does not split its backward runs B + W as one B: the same work, so idle times compare at equal work."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0

    def of(self, kind: str, split: bool) -> float:
        if kind == F:
            return self.f
        if not split:
            return self.b + self.w
        return self.b if kind == B else self.w


@dataclass
class SimResult:
    makespan: float
    bubble: float
    """Idle fraction of the makespan, averaged over ranks (equal on every rank for 1F1B)."""
    peak_inflight: list[int]
    """Per rank: most (micro-batch, chunk) activations held from F to B (the whole activation set)."""
    peak_pending_w: list[int] = field(default_factory=list)
    """Per rank, split schedules: most micro-batches (chunks) whose B ran and W not yet."""
    timeline: list[list[tuple[float, Action]]] = field(default_factory=list)
    """Per rank: (start time, compute action)."""
    idle: float = 0.0
    """Idle time of every rank: the makespan less its compute (all ranks do the same work)."""
    peak_memory: list[float] = field(default_factory=list)
    """Per rank: most activation memory held at once, in stage units (one micro-batch's activations of a
    rank's layers; a chunk is 1/vpp): F->B in flight plus `w_fraction` of a chunk for each pending W (a
    split B frees all but what W reads)."""
    vpp: int = 1

    @property
    def peak_inflight_stages(self) -> list[float]:
        """peak_inflight in units of a whole rank's layers (a stage of 1F1B): a chunk is 1/vpp of it."""
        return [p / self.vpp for p in self.peak_inflight]


class _Replay:
    """Every rank's steps run together under a send model (module doc): round-robin over the ranks, each
    going as far as it can, until none moves; a fixed point with work left is exactly a deadlock."""

    def __init__(self, g: ScheduleGraph, model: SendModel, dur: tuple):
        self.g, self.model, self.rdv, self.dur = g, model, model is SendModel.RENDEZVOUS, dur
        nb, pp = len(g.ops), g.pp
        self.issue, self.post, self.done = [None] * nb, [None] * nb, [None] * nb
        self.pos, self.clock, self.head, self.last = [0] * pp, [0] * pp, [0] * pp, [0] * pp
        self.starts: list[list] = [[] for _ in range(pp)]

    def run(self) -> float:
        """The makespan: when the last rank has waited for its last batch (the executor's last step)."""
        g, progress = self.g, True
        while progress:
            progress = False
            for r in range(g.pp):
                progress |= self._host(r)
        stuck = {
            r: self._where(r)
            for r in range(g.pp)
            if self.pos[r] < len(g.steps[r]) or (self.rdv and self.head[r] < len(g.rank_batches[r]))
        }
        ends = [self._complete(b) for b in range(len(g.ops))]
        if stuck or None in ends:
            raise ScheduleError(f"deadlock ({self.model.value} sends): ranks wait at {stuck or 'a batch'}")
        if g.unmatched:
            raise ScheduleError(f"unreceived messages on channels {g.unmatched}")
        return max(self.clock + ends)

    def _where(self, r: int) -> str:
        if self.pos[r] < len(self.g.steps[r]) and self.g.steps[r][self.pos[r]][0] >= 0:
            return str(self.g.orders[r][len(self.starts[r])])
        return f"batch {self.g.rank_batches[r][self.head[r]]}" if self.rdv else f"step {self.pos[r]}"

    def _host(self, r: int) -> bool:
        steps, done, dur, start = self.g.steps[r], self.done, self.dur, self.starts[r]
        i, c, n = self.pos[r], self.clock[r], len(steps)
        moved = self.rdv and self._stream(r)
        while i < n:
            k, b = steps[i]
            if k < 0:
                self.issue[b] = c
                if not self.rdv:
                    self.post[b] = c
            else:
                if b >= 0:
                    if done[b] is None:  # its stream (or, buffered, its messages) may have moved on
                        self._stream(r) if self.rdv else self._complete(b)
                    d = done[b]
                    if d is None:
                        break
                    c = d if d > c else c  # compute cannot start before its input's batch completed
                start.append(c)
                c += dur[k]
            i += 1
        moved |= i != self.pos[r]
        self.pos[r], self.clock[r] = i, c
        return (self.rdv and self._stream(r)) or moved

    def _complete(self, b: int):
        """BUFFERED: when batch b completes, once its receives' messages are posted (None: not yet)."""
        if self.done[b] is None and self.post[b] is not None:
            t, post = self.post[b], self.post
            for p in (self.g.peers if self.rdv else self.g.recv_peers)[b]:
                if p < 0 or post[p] is None:
                    return None
                t = post[p] if post[p] > t else t
            self.done[b] = t  # a batch completes when its last op does (one Work per batch on NCCL)
        return self.done[b]

    def _stream(self, r: int) -> bool:
        """RENDEZVOUS: post the rank's head batch once issued and the batch before it completed (one stream
        per communicator, batches in order); complete it once every counterpart is posted."""
        mine, h, moved = self.g.rank_batches[r], self.head[r], False
        while h < len(mine) and self.issue[mine[h]] is not None:
            b = mine[h]
            if self.post[b] is None:
                self.post[b] = max(self.issue[b], self.last[r])
                moved = True
            if self._complete(b) is None:
                break
            self.last[r], h, moved = self.done[b], h + 1, True
        self.head[r] = h
        return moved


@contextlib.contextmanager
def _gc_paused():
    """Python's cycle collector off while a schedule is built and replayed: they allocate hundreds of
    thousands of small tuples and no cycles, and each collection walks every cached schedule (half the
    grid test's time went there)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@functools.lru_cache(maxsize=4)
def _graph(kind: str, pp: int, vpp: int, m: int, grouping: Grouping, builder) -> ScheduleGraph:
    """One schedule's graph, kept for the next send model (the grid test replays each schedule under both).
    The builder is part of the key: tests swap build_schedule for a broken one."""
    return ScheduleGraph(kind, pp, vpp, m, grouping, builder)


def simulate(
    kind: str,
    pp: int,
    vpp: int,
    m: int,
    sends: SendModel = SendModel.BUFFERED,
    grouping: Grouping = Grouping.PAIRED,
    backward_time: int = 1,
    costs: Costs | None = None,
    w_fraction: float = W_FRACTION,
) -> SimResult:
    """Replay `build_schedule(kind, pp, vpp, m, rank, grouping)` of every rank under a send model; raises
    ScheduleError on a mismatch, a deadlock, B before F, a missing F/B or activations over the bound.
    costs: F, B, W of one micro-batch through a rank's layers (a chunk takes 1/vpp); None: a chunk's F = 1
    and B = backward_time (zero-bubble kinds B = W = 1), as before costs existed."""
    split = SCHEDULES[kind].split_backward
    # Costs are a whole rank's layers (a stage of 1F1B): a chunk takes 1/vpp of them, so kinds compare at
    # equal work. Without costs a chunk's F takes one unit, as before costs existed.
    if costs is None:
        costs = Costs(1, 1, 1) if split else Costs(1, backward_time, 0)
    else:
        costs = Costs(costs.f / vpp, costs.b / vpp, costs.w / vpp)
    with _gc_paused():
        g = _graph(kind, pp, vpp, m, grouping, build_schedule)
        peak, peak_w, peak_mem = _static_checks(g, w_fraction, vpp, m)
        replay = _Replay(g, sends, tuple(costs.of(k, split) for k in COMPUTE))
        makespan = replay.run()
        # still paused: the timeline is as many small acyclic tuples again as the replay made
        timeline = [list(zip(s, o)) for s, o in zip(replay.starts, g.orders)]
    for r in range(pp):
        if peak[r] > activation_bound(kind, pp, vpp, m, r):
            raise ScheduleError(
                f"rank {r} holds {peak[r]} activations, bound {activation_bound(kind, pp, vpp, m, r)}"
            )
    if split and max(peak_w) > SCHEDULES[kind].pending_w(pp):
        raise ScheduleError(f"a rank holds {max(peak_w)} pending W, bound {SCHEDULES[kind].pending_w(pp)}")
    # Every rank does the same work, one F, B and W per (micro-batch, chunk) (B and W one B unsplit).
    busy = (costs.f + costs.b + costs.w) * m * vpp
    return SimResult(
        makespan,
        (makespan - busy) / makespan,
        peak,
        peak_w,
        timeline,
        makespan - busy,
        [p / vpp for p in peak_mem],
        vpp,
    )


def _static_checks(g: ScheduleGraph, w_fraction: float, vpp: int, m: int) -> tuple:
    """What does not depend on the send model, done once per schedule: every F and B (and W) exactly once
    on every rank, and _memory's figures."""
    key = ("static", w_fraction)
    if key not in g.cache:
        _check_complete(g.orders, g.pp, vpp, m, g.split)
        g.cache[key] = graph_memory(g, w_fraction)
    return g.cache[key]


def _check_complete(orders, pp: int, vpp: int, m: int, split: bool) -> None:
    want = {(k, mb, c) for k in ((F, B, W) if split else (F, B)) for mb in range(m) for c in range(vpp)}
    for r in range(pp):
        got = [(a.kind, a.microbatch, a.chunk) for a in orders[r]]
        if len(got) != len(set(got)) or set(got) != want:
            raise ScheduleError(f"rank {r} does not run every F and B exactly once")


def bubble_formula(pp: int, vpp: int, m: int) -> float:
    """Idle fraction of 1F1B with equal forward and backward times: (pp-1) / (vpp·m + pp-1)."""
    return (pp - 1) / (vpp * m + pp - 1)
