"""Which rank the others wait for: arrivals at collectives, from each rank's hold in them.

Every rank notes how long it was held in each collective it entered (parallel/observe.py: from its arrival
to its release, on its own monotonic clock or CUDA stream). A collective releases its ranks together, so
within one instance the rank held least arrived last, and `max hold - min hold` is how long the first
arriver waited for it: its *lag*. Only differences of one process's own clock are used (clocks of different
processes and hosts are never compared), and nothing is synchronised to measure it.

Per group (an axis over some ranks) the k-th collective of each rank is the same one (a group's ranks
enter its collectives in one program order). Each instance's lag is charged to its last arriver. The
figures weigh by lag, not by count: a rank slow once a step arrives last at the step's first collective
only (the ones after it start together), so by count it would be one among hundreds of near-ties.

  last_arrival_rank   the rank charged the most lag (-1: none stands out: SHARE_MIN, LAG_MIN_FRACTION)
  last_arrival_share  its part of all the lag charged in the window (0..1)
  last_arrival_lag_s  the seconds per step its peers waited for it

Overall figures use the axes whose ranks do the same work (tp, cp, the dp family, ep): there, a rank that
keeps arriving last is slow. pp's own collectives (tied embeddings, the loss, the grad norm) are reported
under straggler/pp/ but left out of the overall figures and the warning: the pipeline's drain makes stage
0 finish its last backward after the others, by design, in every healthy step.
"""

from __future__ import annotations

SAME_WORK = ("tp", "cp", "dp", "dpcp", "ep", "edp", "dp_shard", "dp_rep")
SHARE_MIN = 0.55
"""A rank is named when it caused most of the window's waiting (some ranks wait by the layout itself: under
cp the causal attention's blocks differ in work: a slow rank's peers are never the only ones waited for)
..."""
LAG_MIN_FRACTION = 0.05
"""... and its peers waited for it at least this fraction of a step more than for the others (noise is
spread over the ranks: the excess of one over the rest stays a sliver of the step)."""
LAG_MIN_S = 0.002
PERSIST = 2
"""Log windows in a row naming the same rank before the warning."""


def charge(every: list[dict], ranks_of: dict | None = None) -> tuple[dict, dict]:
    """({axis: {rank: lag s}}, {(axis, ranks): {rank: lag s}}) from every rank's {(axis, ranks): holds}
    (index = global rank)."""
    by_axis: dict[str, dict[int, float]] = {}
    by_group: dict[tuple, dict[int, float]] = {}
    keys = {k for holds in every for k in holds}
    for key in sorted(keys):
        axis, ranks = key
        lists = [every[r].get(key, []) for r in ranks]
        n = min(len(x) for x in lists)
        lag_axis, lag_group = by_axis.setdefault(axis, {}), by_group.setdefault(key, {})
        for k in range(n):
            held = [x[k] for x in lists]
            last = min(range(len(held)), key=held.__getitem__)
            lag = max(held) - held[last]
            rank = ranks[last]
            lag_axis[rank] = lag_axis.get(rank, 0.0) + lag
            lag_group[rank] = lag_group.get(rank, 0.0) + lag
    return by_axis, by_group


def figures(lags: dict[int, float], steps: int, step_time: float, prefix: str) -> dict:
    """The three figures of one scope ({rank: lag}); the rank is -1 unless it stands out."""
    total = sum(lags.values())
    if not lags or total <= 0:
        return {f"{prefix}last_arrival_rank": -1, f"{prefix}last_arrival_share": 0.0,
                f"{prefix}last_arrival_lag_s": 0.0}  # fmt: skip
    rank = max(lags, key=lags.__getitem__)
    share, per_step = lags[rank] / total, lags[rank] / max(1, steps)
    others = [v for r, v in lags.items() if r != rank]
    excess = (lags[rank] - (sum(others) / len(others) if others else 0.0)) / max(1, steps)
    named = share >= SHARE_MIN and excess >= max(LAG_MIN_S, LAG_MIN_FRACTION * step_time)
    return {
        f"{prefix}last_arrival_rank": rank if named else -1,
        f"{prefix}last_arrival_share": share,
        f"{prefix}last_arrival_lag_s": per_step,
    }


def inherited(by_group: dict, p2p: list[float]) -> dict:
    """by_group less the lateness each rank inherited from its pipeline: a rank that waited longer for
    pipeline transfers than its same-work peers arrives late by that much through no fault of its own
    (the next stage of a slow rank waits for its activations, then reaches its dp collective late)."""
    out = {}
    for (axis, ranks), lags in by_group.items():
        base = min(p2p[r] for r in ranks) if p2p else 0.0
        out[(axis, ranks)] = {r: max(0.0, v - (p2p[r] - base if p2p else 0.0)) for r, v in lags.items()}
    return out


def window(
    every: list[dict], steps: int, step_time: float, p2p: list[float] | None = None
) -> tuple[dict, tuple | None]:
    """The straggler/ figures of one log window (overall and per axis) and (rank, group key, lag/step)
    of the named rank, or None. `p2p`: each rank's seconds waiting for pipeline transfers."""
    _, by_group = charge(every)
    by_group = inherited(by_group, p2p or [])
    by_axis: dict[str, dict[int, float]] = {}
    overall: dict[int, float] = {}
    for (axis, _), lags in by_group.items():
        for r, v in lags.items():
            by_axis.setdefault(axis, {})[r] = by_axis.get(axis, {}).get(r, 0.0) + v
            if axis in SAME_WORK:
                overall[r] = overall.get(r, 0.0) + v
    row = figures(overall, steps, step_time, "straggler/")
    for axis, lags in sorted(by_axis.items()):
        row.update(figures(lags, steps, step_time, f"straggler/{axis}/"))
    rank = row["straggler/last_arrival_rank"]
    if rank < 0:
        return row, None
    groups = [(v.get(rank, 0.0), k) for k, v in by_group.items() if k[0] in SAME_WORK and rank in k[1]]
    return row, (rank, max(groups)[1], row["straggler/last_arrival_lag_s"])


class Persistence:
    """The warning line once the same rank is named in PERSIST log windows in a row (then every 10th)."""

    def __init__(self):
        self.rank, self.count = -1, 0

    def update(self, named: tuple | None, hosts: list[str], step: int) -> str | None:
        rank = named[0] if named else -1
        self.count = self.count + 1 if rank == self.rank and rank >= 0 else (1 if rank >= 0 else 0)
        self.rank = rank
        if rank < 0 or not (self.count == PERSIST or (self.count > PERSIST and self.count % 10 == 0)):
            return None
        _, (axis, ranks), lag = named
        host = hosts[rank] if rank < len(hosts) else "?"
        return (
            f"megaframe: warning: rank {rank} (host {host}) arrives last at its collectives: its {axis} "
            f"group (ranks {', '.join(map(str, ranks))}) waited {lag:.3f}s per step for it, {self.count} log "
            f"windows in a row (step {step}; straggler/last_arrival_*)"
        )
