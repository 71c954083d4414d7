"""The whole world agreeing on the outcome of optional per-rank work before any collective of it (a task
that did not load, a library missing on one node): every rank learns which ranks failed and why, so all of
them skip the work together and none waits alone in a collective the failed rank never enters. The one
collective it needs is comm.gather_objects."""

from __future__ import annotations

from megaframe.parallel.comm import gather_objects


def agree(error: str | None, group) -> dict[int, str]:
    """{rank: its error} of the ranks whose part of a piece of optional per-rank work failed (a task that
    did not load, a library missing on one node), the same on every rank: empty means every rank may go on
    into the work's collectives; otherwise all of them skip it, and none waits alone in a collective the
    failed rank never enters. Over the whole-mesh `group` (None: one process)."""
    return {r: e for r, e in enumerate(gather_objects(error, group)) if e is not None}


def named_failures(failed: dict[int, str], world: int) -> str:
    """`failed` (agree's answer) for one line: each reason once, naming its ranks where the job has several
    (the first four: at a thousand ranks failing alike, one line still)."""
    if world == 1:
        return "; ".join(failed.values())
    by_reason: dict[str, list[int]] = {}
    for r, e in sorted(failed.items()):
        by_reason.setdefault(e, []).append(r)
    parts = []
    for e, ranks in by_reason.items():
        more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:4]))}{more}: {e}")
    return "; ".join(parts)
