"""Run every rank's action list together, without processes, and check the schedule.

Time model: each F and B of one chunk takes one unit; a send is asynchronous and delivers when the
sender's compute that produced it has finished; a receive blocks until its message is there.
Checks: the n-th receive on a channel (src, dst, direction) matches the n-th send (same
micro-batch, and the receiver's stage is the sender's stage ± 1), no deadlock, each (microbatch,
chunk) is forwarded before it is backwarded, every F and B happens exactly once, and in-flight
activations never exceed the schedule's bound. Reports the bubble: idle time / makespan per rank.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from megaframe.pipeline.schedule import (B, COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, F, Action,
                                          activation_bound, build_schedule, stage_of)


class ScheduleError(AssertionError):
    pass


@dataclass
class SimResult:
    makespan: int
    bubble: float
    """Idle fraction of the makespan, averaged over ranks (equal on every rank for 1F1B)."""
    peak_inflight: list[int]
    timeline: list[list[tuple[int, Action]]] = field(default_factory=list)
    """Per rank: (start time, compute action)."""


def simulate(kind: str, pp: int, vpp: int, m: int) -> SimResult:
    scheds = [build_schedule(kind, pp, vpp, m, r) for r in range(pp)]
    pos, clock = [0] * pp, [0] * pp
    channels: dict[tuple[int, int, str], deque] = defaultdict(deque)  # (src, dst, dir) -> (mb, stage, t)
    done_f, inflight, peak = set(), [0] * pp, [0] * pp
    timeline: list[list] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(scheds[r]):
                a = scheds[r][pos[r]]
                if not _step(r, a, pp, clock, channels, done_f, inflight, timeline):
                    break  # blocked on a receive
                peak[r] = max(peak[r], inflight[r])
                pos[r] += 1
                progress = True
    stuck = [r for r in range(pp) if pos[r] < len(scheds[r])]
    if stuck:
        raise ScheduleError(f"deadlock: ranks {stuck} wait at {[str(scheds[r][pos[r]]) for r in stuck]}")
    if any(channels.values()):
        raise ScheduleError(f"unreceived messages: {[k for k, v in channels.items() if v]}")
    _check_complete(timeline, pp, vpp, m)
    for r in range(pp):
        if peak[r] > activation_bound(kind, pp, vpp, m, r):
            raise ScheduleError(f"rank {r} holds {peak[r]} activations, bound {activation_bound(kind, pp, vpp, m, r)}")
    makespan = max(clock)
    busy = 2 * m * vpp
    return SimResult(makespan, sum((makespan - busy) / makespan for _ in range(pp)) / pp, peak, timeline)


def _step(r, a: Action, pp, clock, channels, done_f, inflight, timeline) -> bool:
    """Execute one action of rank r if it can run now; False when it must wait."""
    s = stage_of(r, a.chunk, pp)
    if a.kind in (SEND_F, SEND_B):
        direction = "f" if a.kind == SEND_F else "b"
        channels[(r, a.peer, direction)].append((a.microbatch, s, clock[r]))
        return True
    if a.kind in (RECV_F, RECV_B):
        direction = "f" if a.kind == RECV_F else "b"
        q = channels[(a.peer, r, direction)]
        if not q:
            return False
        mb, src_stage, t = q.popleft()
        want = s - 1 if direction == "f" else s + 1
        if mb != a.microbatch or src_stage != want:
            raise ScheduleError(f"rank {r} {a} got micro-batch {mb} from stage {src_stage}")
        clock[r] = max(clock[r], t)
        return True
    assert a.kind in COMPUTE
    key = (a.microbatch, a.chunk, r)
    if a.kind == F:
        done_f.add(key)
        inflight[r] += 1
    else:
        if key not in done_f:
            raise ScheduleError(f"rank {r} runs {a} before its forward")
        inflight[r] -= 1
    timeline[r].append((clock[r], a))
    clock[r] += 1
    return True


def _check_complete(timeline, pp: int, vpp: int, m: int) -> None:
    want = {(k, mb, c) for k in COMPUTE for mb in range(m) for c in range(vpp)}
    for r in range(pp):
        got = [(a.kind, a.microbatch, a.chunk) for _, a in timeline[r]]
        if len(got) != len(set(got)) or set(got) != want:
            raise ScheduleError(f"rank {r} does not run every F and B exactly once")


def bubble_formula(pp: int, vpp: int, m: int) -> float:
    """Idle fraction of 1F1B with equal forward and backward times: (pp-1) / (vpp·m + pp-1)."""
    return (pp - 1) / (vpp * m + pp - 1)
