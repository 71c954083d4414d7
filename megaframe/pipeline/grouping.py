"""Where a rank's sends and receives go between its compute actions (`Grouping`, see schedule.py): PAIRED
(the default: every rank's compute order run in unit time, each message sent and received at the tick its
sender finishes, so each batch's sends meet the peer's receives of the same tick under NCCL's rendezvous
sends) and ADJACENT (receive right before the compute, send right after: deadlock-free only with buffered
sends, kept for the checker's counterexample). The compute orders are the registered specs' (schedule.py)."""

from __future__ import annotations

import functools

from megaframe.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Grouping,
    W,
    locate,
    stage_of,
)
from megaframe.pipeline.schedule import SCHEDULES, compute_order, is_v, paired_forwards


def build_schedule(
    kind: str, pp: int, vpp: int, m: int, rank: int, grouping: Grouping = Grouping.PAIRED
) -> list[Action]:
    """The full action list of `rank`: compute actions with the sends and receives between them."""
    if grouping is Grouping.ADJACENT:
        return _adjacent(kind, pp, vpp, m, rank)
    return list(_paired(kind, pp, vpp, m, rank))


# Cached: the simulator's checks replay one schedule under both send models, and the planner and the
# executor ask for the same one again; a copy is handed out (callers may edit their list).
@functools.lru_cache(maxsize=256)
def _paired(kind: str, pp: int, vpp: int, m: int, rank: int) -> tuple[Action, ...]:
    """build_schedule under Grouping.PAIRED."""
    # Every rank derives the same global timetable, so a send's tick on one rank and its receive's tick on
    # the peer agree without any exchange: that is what pairs the batches under NCCL.
    starts, sent_at = _unit_times(kind, pp, vpp, m)
    v, last = is_v(kind), pp * vpp - 1
    # (time, 0 = comm | 1 = compute, order within a tick, action): at tick t a rank's sends and receives
    # come after its compute that ends at t and before the one that starts at t
    items = []
    # per chunk: its stage and the ranks of the stages before and after it (itself at either end)
    where = [
        (s, locate(s - 1, pp, v)[0] if s > 0 else rank, locate(s + 1, pp, v)[0] if s < last else rank)
        for s in (stage_of(rank, c, pp, v) for c in range(vpp))
    ]
    for i, (a, t) in enumerate(zip(compute_order(kind, pp, vpp, m, rank), starts[rank])):
        s, prev, nxt = where[a.chunk]
        items.append((t, 1, i, a))
        # Neighbouring stages on this same rank (the turn of zbv's V) hand over in memory: no message.
        if a.kind == F:
            if prev != rank:
                items.append(
                    (sent_at[(F, a.microbatch, s - 1)], 0, 1, Action(RECV_F, a.microbatch, a.chunk, prev))
                )
            if nxt != rank:
                items.append((t + 1, 0, 0, Action(SEND_F, a.microbatch, a.chunk, nxt)))
        elif a.kind == B:
            if nxt != rank:
                items.append(
                    (sent_at[(B, a.microbatch, s + 1)], 0, 2, Action(RECV_B, a.microbatch, a.chunk, nxt))
                )
            if prev != rank:
                items.append((t + 1, 0, 0, Action(SEND_B, a.microbatch, a.chunk, prev)))
    # The key stops before the Action (not orderable); full ties keep insertion order (sorted is stable).
    return tuple(a for *_, a in sorted(items, key=lambda x: x[:3]))


def forward_schedule(pp: int, vpp: int, m: int, rank: int, v: bool = False) -> list[Action]:
    """Forward-only (evaluation): GPipe's forward phase with its paired sends and receives. GPipe runs
    every forward before any backward, so dropping the backward actions leaves each forward batch meeting
    the same peer batch as in training (deadlock-free under rendezvous sends, tests/unit). Chunks in a V
    (`v`, zbv's placement, which GPipe has no order for): zbv's own forwards; every message is paired by
    its tick, so the forward messages left still meet their peers' at the same ticks."""
    kind = "zbv" if v else "gpipe"
    return [a for a in build_schedule(kind, pp, vpp, m, rank) if a.kind in (F, SEND_F, RECV_F)]


# Cached: build_schedule asks for the same timetable once per rank (pp times per layout, and the planner
# asks for many layouts); the result is only read.
@functools.lru_cache(maxsize=64)
def _unit_times(kind: str, pp: int, vpp: int, m: int) -> tuple[list[list[int]], dict]:
    """Every rank's compute order run with F = B = W = 1 and instant transfers: (start times per rank, in
    compute order; {(F | B | W, microbatch, stage): time the stage's output is sent})."""
    v, plan = is_v(kind), SCHEDULES[kind].unit_plan
    if plan is not None:  # the greedy ran the unit-time timetable already (zero_bubble_plan)
        orders, starts = plan(pp, m)
        sent_at = {
            (a.kind, a.microbatch, stage_of(r, a.chunk, pp, v)): t + 1
            for r in range(pp)
            for a, t in zip(orders[r], starts[r])
        }
        return starts, sent_at
    return _replay_unit_times(kind, pp, vpp, m)


def _replay_unit_times(kind: str, pp: int, vpp: int, m: int) -> tuple[list[list[int]], dict]:
    """_unit_times by replaying the compute orders: every rank starts each action as soon as it is free and
    the action's input has been sent."""
    orders = [compute_order(kind, pp, vpp, m, r) for r in range(pp)]
    v, last = is_v(kind), pp * vpp - 1
    sent_at: dict = {}
    starts: list[list[int]] = [[] for _ in range(pp)]
    clock = [0] * pp
    pairs = [paired_forwards(kind, pp, vpp, m, r) for r in range(pp)]

    def dep_of(r: int, a: Action):
        s = stage_of(r, a.chunk, pp, v)
        # W waits only for its own B, which comes before it in this rank's order.
        dep = (F, a.microbatch, s - 1) if a.kind == F else (B, a.microbatch, s + 1)
        if a.kind == W or (dep[0] == F and s == 0) or (dep[0] == B and s == last):
            return s, None
        return s, dep

    # Fixed point: sweep the ranks until none can start its next action; a rank blocks on a dependency
    # another rank has yet to produce, like the real pipeline with instant transfers.
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while len(starts[r]) < len(orders[r]):
                i = len(starts[r])
                # an overlapped kind's steady pair (F, then another micro-batch's B) is one tick
                n = 2 if i in pairs[r] else 1
                deps = [dep_of(r, a) for a in orders[r][i : i + n]]
                if any(d is not None and d not in sent_at for _, d in deps):
                    break  # an input is not computed yet
                # Starts when both the rank is free and the inputs have been sent (transfers take no time).
                t = max([clock[r]] + [sent_at[d] for _, d in deps if d is not None])
                for a, (s, _) in zip(orders[r][i : i + n], deps):
                    starts[r].append(t)
                    sent_at[(a.kind, a.microbatch, s)] = t + 1
                clock[r] = t + 1
                progress = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        raise ValueError(f"{kind} pp={pp} vpp={vpp} m={m}: the compute orders wait on each other")
    return starts, sent_at


def _adjacent(kind: str, pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    """Grouping.ADJACENT: each receive right before its compute, each send right after."""
    v, last = is_v(kind), pp * vpp - 1
    out: list[Action] = []
    for a in compute_order(kind, pp, vpp, m, rank):
        s = stage_of(rank, a.chunk, pp, v)
        prev = locate(s - 1, pp, v)[0] if s > 0 else rank
        nxt = locate(s + 1, pp, v)[0] if s < last else rank
        if a.kind == F:
            if prev != rank:
                out.append(Action(RECV_F, a.microbatch, a.chunk, prev))
            out.append(a)
            if nxt != rank:
                out.append(Action(SEND_F, a.microbatch, a.chunk, nxt))
        elif a.kind == B:
            if nxt != rank:
                out.append(Action(RECV_B, a.microbatch, a.chunk, nxt))
            out.append(a)
            if prev != rank:
                out.append(Action(SEND_B, a.microbatch, a.chunk, prev))
        else:
            out.append(a)
    return out
