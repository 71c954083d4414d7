"""The zero-bubble schedules' compute orders (zb_h1, zbv; Qi et al. 2024): one greedy list scheduler run
in unit time on every rank together. At each tick an idle rank runs a ready B if any (the critical path),
else a ready F within its activation limit and with fewer than its W cap pending, else its oldest pending W.
What tells the kinds apart is their `GreedyRule` (placement, W cap, activation limit), carried by each
kind's ScheduleSpec: nothing here branches on a kind's name."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass

from megaframe.pipeline.actions import Action, B, F, W, stage_of


@dataclass(frozen=True, kw_only=True)
class GreedyRule:
    """What the greedy list scheduler holds one zero-bubble kind's ranks to."""

    name: str
    """The kind (named in the scheduler's errors)."""
    v: bool
    """Two chunks per rank in a V (rank r holds stages r and 2·pp-1-r); else one chunk per rank."""
    pending_w: Callable[[int], int]
    """pp -> most micro-batches (chunks under a V) a rank holds between B and W: the bubble's price."""
    activations: Callable[[int, int], int]
    """(pp, rank) -> chunk activations the rank may hold from F to B."""


ZB_H1 = GreedyRule(name="zb_h1", v=False, pending_w=lambda pp: pp, activations=lambda pp, rank: pp - rank)
"""1F1B's in-flight activations on every rank (pp - rank micro-batches from F to B), up to pp pending W."""
ZBV = GreedyRule(name="zbv", v=True, pending_w=lambda pp: 2 * pp, activations=lambda pp, rank: 2 * pp)
"""1F1B's largest rank (rank 0's pp micro-batches of a stage, each two zbv chunks) on every rank."""


@functools.lru_cache(maxsize=64)
def zero_bubble_orders(rule: GreedyRule, pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's compute order of a zero-bubble kind (held to `rule`), from a greedy list schedule in
    unit time.

    All ranks advance one tick together (F = B = W = 1, instant transfers). At each tick a free rank runs,
    in priority: a ready B (its output gradient has arrived; the input gradient it sends is what the
    previous stage waits for), else a ready F while it holds fewer than its limit of activations (counted
    from F to B) and fewer than its W cap wait, else its oldest pending W; each chunk's F and B go in
    micro-batch order. Ties go to the higher stage (nearer the loss under F, further from the end under B).
    The W cap is what buys the bubble: the last rank defers its W so that B runs back up the pipe at one
    tick a stage, and the first ranks keep W for the cool-down, where they would otherwise wait for B.
    """
    return zero_bubble_plan(rule, pp, m)[0]


@functools.lru_cache(maxsize=64)
def zero_bubble_plan(
    rule: GreedyRule, pp: int, m: int
) -> tuple[tuple[tuple[Action, ...], ...], list[list[int]]]:
    """(zero_bubble_orders' orders, the tick each action starts at). The greedy never idles a rank whose
    next action is ready (a W always is; a B or F it skips stays unready while the rank idles), so these
    ticks are the unit-time replay's (grouping.py's _unit_times): it reuses them instead of replaying
    (the grid test's time)."""
    v = rule.v
    vpp = 2 if v else 1
    last, never = pp * vpp - 1, 1 << 60
    # done_f[s][mb] / done_b[s][mb]: the tick F / B of micro-batch mb at stage s finishes (never: not run)
    done_f, done_b = [[never] * m for _ in range(last + 1)], [[never] * m for _ in range(last + 1)]
    # each rank's chunks, higher stage first (the tie rule), as [chunk, stage, next F, next B]
    lanes = [
        sorted(([c, stage_of(r, c, pp, v), 0, 0] for c in range(vpp)), key=lambda x: -x[1]) for r in range(pp)
    ]
    pending_w: list[collections.deque] = [collections.deque() for _ in range(pp)]
    held, orders, starts = [0] * pp, [[] for _ in range(pp)], [[] for _ in range(pp)]
    cap_w, total, t, busy = rule.pending_w(pp), 3 * m * vpp, 0, pp
    limits = [rule.activations(pp, r) for r in range(pp)]
    while busy:
        for r in range(pp):
            room = len(pending_w[r]) < cap_w  # else W first: it frees what B kept
            a = _pick(lanes[r], t, m, last, done_f, done_b, pending_w[r], room, room and held[r] < limits[r])
            if a is None:
                continue
            orders[r].append(a)
            starts[r].append(t)
            if len(orders[r]) == total:
                busy -= 1
            if a.kind == W:
                pending_w[r].popleft()
            elif a.kind == F:
                held[r] += 1
            else:
                held[r] -= 1
                pending_w[r].append(Action(W, a.microbatch, a.chunk))
        t += 1
        if t > 4 * total * pp:  # every tick some rank can move unless the limits wait on each other
            raise ValueError(f"{rule.name} pp={pp} m={m}: the greedy schedule does not finish")
    return tuple(tuple(o) for o in orders), starts


def _pick(lanes, t, m, last, done_f, done_b, pending_w, may_back, may_forward) -> Action | None:
    """The action a rank starts at tick t under zero_bubble_orders' priorities (None: it idles); marks
    when a chosen F or B finishes and moves its lane on."""
    if may_back:
        for lane in lanes:
            c, s, nf, mb = lane
            # a B needs its own F done and, off the last stage, the next stage's B
            if mb < nf and done_f[s][mb] <= t and (s == last or done_b[s + 1][mb] <= t):
                lane[3] += 1
                done_b[s][mb] = t + 1
                return Action(B, mb, c)
    if may_forward:
        for lane in lanes:
            c, s, mb, _ = lane
            if mb < m and (s == 0 or done_f[s - 1][mb] <= t):
                lane[2] += 1
                done_f[s][mb] = t + 1
                return Action(F, mb, c)
    return pending_w[0] if pending_w else None
