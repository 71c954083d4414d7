"""A pipeline schedule compiled for the simulator's replay (pipeline/simulate.py): every rank's host steps
and every batch's counterpart batches, the messages matched and checked before any time passes, and the
activation memory each rank holds (F to B, pending W)."""

from __future__ import annotations

from collections import defaultdict

from megaframe.pipeline.actions import (
    COMPUTE,
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
from megaframe.pipeline.grouping import build_schedule
from megaframe.pipeline.schedule import SCHEDULES, is_v


class ScheduleError(AssertionError):
    pass


class ScheduleGraph:
    """One schedule compiled for the replay, once for both send models: per rank its host steps (a compute,
    with the batch bringing its input, or the issue of a batch) and per batch its ops' counterpart batches.
    A rank posts in program order under both models, so which op meets which is known before any time
    passes: the messages are checked here and the replay only times them."""

    def __init__(self, kind, pp, vpp, m, grouping: Grouping, builder=build_schedule):
        self.pp, self.vpp, self.v, self.split = pp, vpp, is_v(kind), SCHEDULES[kind].split_backward
        self.cache: dict = {}  # what the send models share (_static_checks)
        self.orders: list[list[Action]] = []
        self.steps: list[list[tuple[int, int]]] = []
        """Per rank: (0 F | 1 B | 2 W, the batch it waits for or -1), or (-1, the batch it issues)."""
        self.rank_batches: list[list[int]] = []
        self.ops: list[list] = []  # per batch: (is a send, channel key, index in that channel)
        # (sender, receiver) -> ([(batch, message)], [(batch, expected)])
        chans: dict = defaultdict(lambda: ([], []))
        for r in range(pp):
            self._compile(r, builder(kind, pp, vpp, m, r, grouping), chans)
        for (src, dst), (sent, want) in chans.items():
            for n, ((_, s), (_, w)) in enumerate(zip(sent, want)):
                if s != w:
                    raise ScheduleError(
                        f"rank {dst}: message {n} from rank {src} to {dst} is {s}, the receive expects {w}"
                    )
        self.unmatched = [k for k, (s, w) in chans.items() if len(s) != len(w)]
        # per batch, the batches holding its ops' counterparts (-1: none, it never completes): every op's
        # under RENDEZVOUS, the receives' only under BUFFERED (a send is delivered when posted)
        self.peers: list[list[int]] = [[] for _ in self.ops]
        self.recv_peers: list[list[int]] = [[] for _ in self.ops]
        for b, ops in enumerate(self.ops):
            for is_send, key, k in ops:
                other = chans[key][1 if is_send else 0]
                peer = other[k][0] if k < len(other) else -1
                self.peers[b].append(peer)
                if not is_send:
                    self.recv_peers[b].append(peer)

    def _compile(self, r: int, sched: list[Action], chans: dict) -> None:
        steps, order, arriving, mine, i = [], [], {}, [], 0
        # per (receive kind, chunk): the sending stage's chunk (_expects without a call per message)
        src = {
            (k, c): self._expects(r, Action(k, 0, c))[2]
            for k in (RECV_F, RECV_B)
            for c in range(self.vpp)
            if 0 <= stage_of(r, c, self.pp, self.v) + (-1 if k == RECV_F else 1) < self.pp * self.vpp
        }
        while i < len(sched):
            a = sched[i]
            if a.kind in (F, B, W):
                order.append(a)
                # the executor waits for the batch that brings this compute's input (W's came with its B)
                steps.append(
                    (
                        COMPUTE.index(a.kind),
                        -1
                        if a.kind == W
                        else arriving.get((RECV_F if a.kind == F else RECV_B, a.microbatch, a.chunk), -1),
                    )
                )
                i += 1
                continue
            b, ops = len(self.ops), []
            while i < len(sched) and sched[i].kind not in (F, B, W):
                o, i = sched[i], i + 1
                is_send = o.kind in (SEND_F, SEND_B)
                # Keyed by (sender, receiver) only, no direction
                # or tag: NCCL matches p2p ops in posting order.
                key = (r, o.peer) if is_send else (o.peer, r)
                side = chans[key][0 if is_send else 1]
                side.append(
                    (
                        b,
                        (
                            o.kind[-1],
                            o.microbatch,
                            o.chunk if is_send else src[(o.kind, o.chunk)],
                            r if is_send else o.peer,
                        ),
                    )
                )
                ops.append((is_send, key, len(side) - 1))
                if not is_send:
                    arriving[(o.kind, o.microbatch, o.chunk)] = b
            steps.append((-1, b))
            mine.append(b)
            self.ops.append(ops)
        self.steps.append(steps)
        self.orders.append(order)
        self.rank_batches.append(mine)

    def _expects(self, r: int, a: Action) -> tuple:
        """(direction, micro-batch, chunk, rank) of the send this receive must match."""
        s = stage_of(r, a.chunk, self.pp, self.v)
        src = s - 1 if a.kind == RECV_F else s + 1
        return (a.kind[-1], a.microbatch, locate(src, self.pp, self.v)[1], a.peer)


def graph_memory(g: ScheduleGraph, w_fraction: float) -> tuple[list[int], list[int], list[float]]:
    """Per rank: peak chunk activations from F to B, peak pending W, peak of both (a W at w_fraction);
    raises where a B or W runs before its F. Only the order matters, not the times."""
    peak, peak_w, peak_mem = [], [], []
    for r, order in enumerate(g.orders):
        seen, held, pend, p, pw, pm = set(), 0, 0, 0, 0, 0.0
        for a in order:
            if a.kind == F:
                seen.add((a.microbatch, a.chunk))
                held += 1
            elif (a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"rank {r} runs {a} before its forward")
            else:
                # B frees the activations; a split one keeps what
                # W needs (the weighted layers' inputs) until W
                held -= a.kind == B
                pend += (1 if a.kind == B else -1) if g.split else 0
            p, pw, pm = max(p, held), max(pw, pend), max(pm, held + w_fraction * pend)
        peak.append(p)
        peak_w.append(pw)
        peak_mem.append(pm)
    return peak, peak_w, peak_mem
