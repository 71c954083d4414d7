"""Pipeline schedules as data: a pure function from (kind, pp, vpp, microbatches, rank) to actions.

Virtual stages: chunk c of pipeline rank r is stage s = c·pp + r (Megatron/torchtitan "loop" order),
so a micro-batch visits rank 0, 1, ..., pp-1, then rank 0 again for chunk 1, and so on.

A rank's schedule is a flat list of `Action`s. Compute actions are F (forward) and B (backward) of
(microbatch, chunk). Between them sit the point-to-point actions that move activations between
neighbouring stages: SEND_F after an F whose output goes to another stage, RECV_F somewhere before an
F whose input comes from one; SEND_B after a B, RECV_B before a B. The executor issues consecutive
communication actions as one batched isend/irecv and waits for a batch that receives.

Where the receives go (`Grouping`) decides whether the schedule survives NCCL (DESIGN §1.3c): there a
send completes only once the peer has posted the matching receive, and a group's batches run in
order on one stream. PAIRED (the default) runs every rank's compute order in unit time (F = B = 1)
and gives every message a tick, the time its sender finishes the compute that produces it; the
sender sends at that tick and the receiver posts the receive at the same tick, so each batch's sends
meet receives in the peer's batch of the same tick (Megatron's pairing, send_forward_recv_backward
and send_forward_backward_recv_forward_backward, derived for every schedule). Ticks advance on every
rank together and what a rank sends at tick t depends only on what arrived before t, so no ring of
waiting batches can form, whatever the real compute times; with F = B the receives cost no idle
time either, so the bubble is the schedule's own. ADJACENT (receive right before the compute that
needs it, send right after) is deadlock-free only with buffered sends (gloo); kept for the checker's
counterexample.

Kinds: gpipe (all forwards, then all backwards), 1f1b (Megatron's one-forward-one-backward), and
interleaved (1F1B over vpp chunks per rank; needs microbatches % pp == 0).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

F, B = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B)


class Grouping(enum.Enum):
    PAIRED = "paired"
    """Receives posted at their message's tick, in the batch of the peer's matching send (NCCL-safe)."""
    ADJACENT = "adjacent"
    """Each receive right before the compute that needs it (deadlocks interleaved schedules on NCCL)."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. For communication, `peer` is the other pipeline rank."""

    kind: str
    microbatch: int
    chunk: int
    peer: int = -1

    def __str__(self) -> str:
        tail = f"->{self.peer}" if self.kind.startswith("SEND") else (f"<-{self.peer}" if self.peer >= 0 else "")
        return f"{self.kind}{self.microbatch}.{self.chunk}{tail}"


def stage_of(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def check_args(kind: str, pp: int, vpp: int, m: int) -> None:
    """Raise ValueError when the schedule cannot be built (names the offending setting)."""
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"parallel.pp_schedule={kind!r} must be gpipe, 1f1b or interleaved")
    if pp < 1 or vpp < 1 or m < 1:
        raise ValueError(f"pp={pp}, vpp={vpp} and microbatches={m} must all be >= 1")
    if kind == "1f1b" and vpp != 1:
        raise ValueError("parallel.pp_schedule=1f1b runs one chunk per rank: use parallel.vpp=1 or interleaved")
    if kind == "interleaved" and vpp < 2:
        raise ValueError("interleaved 1F1B needs parallel.vpp >= 2 (vpp=1 is plain 1f1b)")
    # _virtual walks micro-batches in groups of pp per chunk: it has no rule for a partial group.
    if kind == "interleaved" and m % pp != 0:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of parallel.pp={pp}")


def _virtual(k: int, pp: int, vpp: int, m: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) on a rank.

    Micro-batches go in groups of pp: each group runs through chunk 0, then chunk 1, ...
    (backwards through the chunks in reverse). With vpp = 1 this is simply (k, 0).
    """
    if vpp == 1:
        return k, 0
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    return group * pp + within % pp, (chunk if forward else vpp - 1 - chunk)


def num_warmup(kind: str, pp: int, vpp: int, m: int, rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    total = m * vpp
    if kind == "gpipe":
        return total
    if kind == "1f1b":
        # Enough forwards to fill the pipe downstream: the last rank starts its first backward at once.
        return min(total, pp - rank - 1)
    # Megatron's interleaved warm-up: a full round of the other chunks ((vpp-1)·pp) plus twice the
    # distance to the last rank, so the first backward's input has arrived when the rank starts it.
    return min(total, (pp - rank - 1) * 2 + (vpp - 1) * pp)


def compute_order(kind: str, pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    """The F/B sequence of one rank: warm-up forwards, steady 1F1B pairs, cool-down backwards."""
    check_args(kind, pp, vpp, m)
    if kind == "gpipe":  # every micro-batch through chunk 0, then chunk 1, ...; backwards in reverse
        fwd = [Action(F, mb, c) for c in range(vpp) for mb in range(m)]
        return fwd + [Action(B, mb, c) for c in reversed(range(vpp)) for mb in range(m)]
    total, warm = m * vpp, num_warmup(kind, pp, vpp, m, rank)
    out = [Action(F, *_virtual(k, pp, vpp, m, True)) for k in range(warm)]
    for i in range(total - warm):
        out.append(Action(F, *_virtual(warm + i, pp, vpp, m, True)))
        out.append(Action(B, *_virtual(i, pp, vpp, m, False)))
    out += [Action(B, *_virtual(k, pp, vpp, m, False)) for k in range(total - warm, total)]
    return out


def build_schedule(kind: str, pp: int, vpp: int, m: int, rank: int,
                   grouping: Grouping = Grouping.PAIRED) -> list[Action]:
    """The full action list of `rank`: compute actions with the sends and receives between them."""
    if grouping is Grouping.ADJACENT:
        return _adjacent(kind, pp, vpp, m, rank)
    # Every rank derives the same global timetable, so a send's tick on one rank and its receive's tick on
    # the peer agree without any exchange: that is what pairs the batches under NCCL.
    starts, sent_at = _unit_times(kind, pp, vpp, m)
    last = pp * vpp - 1
    # Modulo pp: under interleaving the last rank's chunk c feeds rank 0's chunk c + 1.
    prev_rank, next_rank = (rank - 1) % pp, (rank + 1) % pp
    # (time, 0 = comm | 1 = compute, order within a tick, action): at tick t a rank's sends and receives
    # come after its compute that ends at t and before the one that starts at t
    items = []
    for i, (a, t) in enumerate(zip(compute_order(kind, pp, vpp, m, rank), starts[rank])):
        s = stage_of(rank, a.chunk, pp)
        items.append((t, 1, i, a))
        if a.kind == F:
            if s > 0:
                items.append((sent_at[(F, a.microbatch, s - 1)], 0, 1, Action(RECV_F, a.microbatch, a.chunk, prev_rank)))
            if s < last:
                items.append((t + 1, 0, 0, Action(SEND_F, a.microbatch, a.chunk, next_rank)))
        else:
            if s < last:
                items.append((sent_at[(B, a.microbatch, s + 1)], 0, 2, Action(RECV_B, a.microbatch, a.chunk, next_rank)))
            if s > 0:
                items.append((t + 1, 0, 0, Action(SEND_B, a.microbatch, a.chunk, prev_rank)))
    # The key stops before the Action (not orderable); full ties keep insertion order (sorted is stable).
    return [a for *_, a in sorted(items, key=lambda x: x[:3])]


def forward_schedule(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    """Forward-only (evaluation): GPipe's forward phase with its paired sends and receives. GPipe runs
    every forward before any backward, so dropping the backward actions leaves each forward batch meeting
    the same peer batch as in training (deadlock-free under rendezvous sends, tests/unit)."""
    return [a for a in build_schedule("gpipe", pp, vpp, m, rank) if a.kind in (F, SEND_F, RECV_F)]


# Cached: build_schedule asks for the same timetable once per rank (pp times per layout, and the planner
# asks for many layouts); the result is only read.
@functools.lru_cache(maxsize=64)
def _unit_times(kind: str, pp: int, vpp: int, m: int) -> tuple[list[list[int]], dict]:
    """Every rank's compute order run with F = B = 1 and instant transfers: (start times per rank, in
    compute order; {(F | B, microbatch, stage): time the stage's output is sent})."""
    orders = [compute_order(kind, pp, vpp, m, r) for r in range(pp)]
    last = pp * vpp - 1
    sent_at: dict = {}
    starts: list[list[int]] = [[] for _ in range(pp)]
    clock = [0] * pp
    # Fixed point: sweep the ranks until none can start its next action; a rank blocks on a dependency
    # another rank has yet to produce, like the real pipeline with instant transfers.
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while len(starts[r]) < len(orders[r]):
                a = orders[r][len(starts[r])]
                s = stage_of(r, a.chunk, pp)
                dep = (F, a.microbatch, s - 1) if a.kind == F else (B, a.microbatch, s + 1)
                if (dep[0] == F and s == 0) or (dep[0] == B and s == last):
                    dep = None
                if dep is not None and dep not in sent_at:
                    break  # its input is not computed yet
                # Starts when both the rank is free and the input has been sent (transfers take no time).
                starts[r].append(max(clock[r], sent_at[dep] if dep else 0))
                clock[r] = sent_at[(a.kind, a.microbatch, s)] = starts[r][-1] + 1
                progress = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        raise ValueError(f"{kind} pp={pp} vpp={vpp} m={m}: the compute orders wait on each other")
    return starts, sent_at


def _adjacent(kind: str, pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    """Grouping.ADJACENT: each receive right before its compute, each send right after."""
    last = pp * vpp - 1
    prev_rank, next_rank = (rank - 1) % pp, (rank + 1) % pp
    out: list[Action] = []
    for a in compute_order(kind, pp, vpp, m, rank):
        s = stage_of(rank, a.chunk, pp)
        if a.kind == F:
            if s > 0:
                out.append(Action(RECV_F, a.microbatch, a.chunk, prev_rank))
            out.append(a)
            if s < last:
                out.append(Action(SEND_F, a.microbatch, a.chunk, next_rank))
        else:
            if s < last:
                out.append(Action(RECV_B, a.microbatch, a.chunk, next_rank))
            out.append(a)
            if s > 0:
                out.append(Action(SEND_B, a.microbatch, a.chunk, prev_rank))
    return out


def resolve_kind(kind: str, vpp: int) -> str:
    """parallel.pp_schedule=auto means interleaved when vpp > 1, else 1f1b."""
    if kind == "auto":
        return "interleaved" if vpp > 1 else "1f1b"
    return kind


def activation_bound(kind: str, pp: int, vpp: int, m: int, rank: int) -> int:
    """Most forwards a rank holds activations for at once (the schedule's memory bound)."""
    # +1: in the steady state the next forward runs before the oldest backward frees its activations.
    return min(m * vpp, num_warmup(kind, pp, vpp, m, rank) + 1)
