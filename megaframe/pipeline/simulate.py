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
carry what that receive expects (direction, micro-batch, the neighbouring stage).
Time model: F takes one unit, B `backward_time` units (default 1), transfers none. Checks: matching, no deadlock, each
(microbatch, chunk) forwarded before it is backwarded, every F and B exactly once, in-flight
activations within the schedule's bound. Reports the bubble: idle time / makespan per rank.
"""
from __future__ import annotations

import enum
from collections import defaultdict, deque
from dataclasses import dataclass, field

from megaframe.pipeline.schedule import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    ZERO_BUBBLE,
    Action,
    B,
    F,
    Grouping,
    activation_bound,
    build_schedule,
    is_v,
    locate,
    max_pending_w,
    stage_of,
)


class ScheduleError(AssertionError):
    pass


class SendModel(enum.Enum):
    BUFFERED = "buffered"
    RENDEZVOUS = "rendezvous"


@dataclass
class SimResult:
    makespan: int
    bubble: float
    """Idle fraction of the makespan, averaged over ranks (equal on every rank for 1F1B)."""
    peak_inflight: list[int]
    """Per rank: most (micro-batch, chunk) activations held from F to B (the whole activation set)."""
    peak_pending_w: list[int] = field(default_factory=list)
    """Per rank, split schedules: most micro-batches (chunks) whose B ran and W not yet."""
    timeline: list[list[tuple[int, Action]]] = field(default_factory=list)
    """Per rank: (start time, compute action)."""


@dataclass
class _Batch:
    rank: int
    ops: list[Action]
    issued: int
    posted: int | None = None
    done: int | None = None
    op_index: list = field(default_factory=list)
    """Per op: (is a send, (sender, receiver), its index in that channel)."""


@dataclass
class _Channel:
    """One (sender, receiver) FIFO: (message, post time) of the sends and the receives, in order."""

    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)


class _Sim:
    def __init__(self, kind, pp, vpp, m, model: SendModel, grouping: Grouping, backward_time: int = 1):
        self.pp, self.vpp, self.m, self.model, self.backward_time = pp, vpp, m, model, backward_time
        self.v, self.split = is_v(kind), kind in ZERO_BUBBLE
        self.scheds = [build_schedule(kind, pp, vpp, m, r, grouping) for r in range(pp)]
        self.pos, self.clock = [0] * pp, [0] * pp
        self.pending: list[deque] = [deque() for _ in range(pp)]  # a rank's batches not yet done, in order
        self.arriving: list[dict] = [{} for _ in range(pp)]  # (RECV_F | RECV_B, mb, chunk) -> its batch
        self.last_done = [0] * pp
        self.channels: dict = defaultdict(_Channel)
        self.done_f, self.inflight, self.peak = set(), [0] * pp, [0] * pp
        self.pending_w, self.peak_w = [0] * pp, [0] * pp
        self.timeline: list[list] = [[] for _ in range(pp)]

    def run(self) -> None:
        # Round-robin until no rank can move: a fixed point with work left is exactly a deadlock.
        progress = True
        while progress:
            progress = False
            for r in range(self.pp):
                progress |= self._advance_stream(r)
                progress |= self._advance_host(r)
        stuck = [r for r in range(self.pp) if self.pos[r] < len(self.scheds[r]) or self.pending[r]]
        if stuck:
            where = {r: [str(a) for a in self.pending[r][0].ops] if self.pending[r] else str(self.scheds[r][self.pos[r]])
                     for r in stuck}
            raise ScheduleError(f"deadlock ({self.model.value} sends): ranks wait at {where}")
        unreceived = [k for k, ch in self.channels.items() if len(ch.sends) != len(ch.recvs)]
        if unreceived:
            raise ScheduleError(f"unreceived messages on channels {unreceived}")

    def _advance_host(self, r: int) -> bool:
        moved = False
        while self.pos[r] < len(self.scheds[r]):
            a = self.scheds[r][self.pos[r]]
            if a.kind in COMPUTE:
                batch = self.arriving[r].get((RECV_F if a.kind == F else RECV_B, a.microbatch, a.chunk))
                if batch is not None:  # the executor waits for the batch that brings this compute's input
                    if batch.done is None:
                        return moved
                    # The wait: compute cannot start before the batch bringing its input has completed.
                    self.clock[r] = max(self.clock[r], batch.done)
                self._compute(r, a)
                self.pos[r] += 1
            else:
                ops = []
                while self.pos[r] < len(self.scheds[r]) and self.scheds[r][self.pos[r]].kind not in COMPUTE:
                    ops.append(self.scheds[r][self.pos[r]])
                    self.pos[r] += 1
                batch = _Batch(r, ops, self.clock[r])
                self.pending[r].append(batch)
                if self.model is SendModel.BUFFERED:
                    self._post(batch, self.clock[r])
                for o in ops:
                    if o.kind in (RECV_F, RECV_B):
                        self.arriving[r][(o.kind, o.microbatch, o.chunk)] = batch
                self._advance_stream(r)
            moved = True
        return moved

    def _advance_stream(self, r: int) -> bool:
        """Complete what can complete; under RENDEZVOUS post the head batch once the one before is done."""
        moved = False
        if self.model is SendModel.BUFFERED:
            for b in list(self.pending[r]):  # no order between batches: each op runs on its own
                if self._try_complete(b):
                    self.pending[r].remove(b)
                    moved = True
            return moved
        while self.pending[r]:
            head = self.pending[r][0]
            # Only the head is posted: NCCL runs a communicator's batches in order on one stream.
            if head.posted is None:
                self._post(head, max(head.issued, self.last_done[r]))
                moved = True
            if not self._try_complete(head):
                return moved
            self.pending[r].popleft()
            self.last_done[r] = head.done
            moved = True
        return moved

    def finish_time(self, r: int) -> int:
        """The rank's clock once it has waited for every batch (the executor's last step)."""
        return max([self.clock[r]] + [b.done for b in self.arriving[r].values()] + [self.last_done[r]])

    def _post(self, b: _Batch, t: int) -> None:
        """Post every op of the batch at time t; note each op's place in its channel."""
        b.posted, b.op_index = t, []
        for a in b.ops:
            is_send = a.kind in (SEND_F, SEND_B)
            # Keyed by (sender, receiver) only, no direction or tag: NCCL matches p2p ops in posting order.
            key = (b.rank, a.peer) if is_send else (a.peer, b.rank)
            side = self.channels[key].sends if is_send else self.channels[key].recvs
            side.append((self._message(b.rank, a) if is_send else self._expects(b.rank, a), t))
            b.op_index.append((is_send, key, len(side) - 1))

    def _try_complete(self, b: _Batch) -> bool:
        if b.posted is None:
            return False
        times = [b.posted]
        for is_send, key, n in b.op_index:
            ch = self.channels[key]
            other = ch.recvs if is_send else ch.sends
            if is_send and self.model is SendModel.BUFFERED:
                continue  # delivered when sent; the receive checks the message
            if len(other) <= n:
                return False  # the matching op is not posted yet
            times.append(other[n][1])
            sent, want = (ch.sends[n][0], other[n][0]) if is_send else (other[n][0], ch.recvs[n][0])
            if sent != want:
                raise ScheduleError(f"rank {b.rank}: message {n} from rank {key[0]} to {key[1]} is {sent}, "
                                    f"the receive expects {want}")
        # A batch completes when its last op does (one Work per batch on NCCL).
        b.done = max(times)
        return True

    @staticmethod
    def _message(r: int, a: Action) -> tuple:
        return (a.kind[-1], a.microbatch, a.chunk, r)

    def _expects(self, r: int, a: Action) -> tuple:
        """(direction, micro-batch, chunk, rank) of the send this receive must match."""
        s = stage_of(r, a.chunk, self.pp, self.v)
        src = s - 1 if a.kind == RECV_F else s + 1
        return (a.kind[-1], a.microbatch, locate(src, self.pp, self.v)[1], a.peer)

    def _compute(self, r: int, a: Action) -> None:
        key = (a.microbatch, a.chunk, r)
        if a.kind == F:
            self.done_f.add(key)
            self.inflight[r] += 1
            self.peak[r] = max(self.peak[r], self.inflight[r])
        else:
            if key not in self.done_f:
                raise ScheduleError(f"rank {r} runs {a} before its forward")
            # B frees the activations; a split one keeps what W needs (the weighted layers' inputs) until W.
            if a.kind == B:
                self.inflight[r] -= 1
            if self.split:
                self.pending_w[r] += 1 if a.kind == B else -1
                self.peak_w[r] = max(self.peak_w[r], self.pending_w[r])
        self.timeline[r].append((self.clock[r], a))
        # Unsplit, B is the whole backward (backward_time units); split, B and W take one unit each.
        self.clock[r] += self.backward_time if (a.kind == B and not self.split) else 1


def simulate(kind: str, pp: int, vpp: int, m: int, sends: SendModel = SendModel.BUFFERED,
             grouping: Grouping = Grouping.PAIRED, backward_time: int = 1) -> SimResult:
    """Replay `build_schedule(kind, pp, vpp, m, rank, grouping)` of every rank under a send model; raises
    ScheduleError on a mismatch, a deadlock, B before F, a missing F/B or activations over the bound."""
    sim = _Sim(kind, pp, vpp, m, sends, grouping, backward_time)
    sim.run()
    _check_complete(sim.timeline, pp, vpp, m, sim.split)
    for r in range(pp):
        if sim.peak[r] > activation_bound(kind, pp, vpp, m, r):
            raise ScheduleError(f"rank {r} holds {sim.peak[r]} activations, bound {activation_bound(kind, pp, vpp, m, r)}")
    makespan = max(sim.finish_time(r) for r in range(pp))
    # Every rank does the same work, one F and one B (and W) per (micro-batch, chunk); the rest is bubble.
    busy = (3 if sim.split else 1 + backward_time) * m * vpp
    if sim.split and max(sim.peak_w) > max_pending_w(kind, pp):
        raise ScheduleError(f"a rank holds {max(sim.peak_w)} pending W, bound {max_pending_w(kind, pp)}")
    return SimResult(makespan, (makespan - busy) / makespan, sim.peak, sim.peak_w, sim.timeline)


def _check_complete(timeline, pp: int, vpp: int, m: int, split: bool) -> None:
    want = {(k, mb, c) for k in (COMPUTE if split else (F, B)) for mb in range(m) for c in range(vpp)}
    for r in range(pp):
        got = [(a.kind, a.microbatch, a.chunk) for _, a in timeline[r]]
        if len(got) != len(set(got)) or set(got) != want:
            raise ScheduleError(f"rank {r} does not run every F and B exactly once")


def bubble_formula(pp: int, vpp: int, m: int) -> float:
    """Idle fraction of 1F1B with equal forward and backward times: (pp-1) / (vpp·m + pp-1)."""
    return (pp - 1) / (vpp * m + pp - 1)
