"""The planner's memory against the published per-GPU memory (planning.published, torchtitan's reserved
peaks): the given rows within the issue's 0.85-1.15, one rule for every row (no per-row constant: the
device's allocator headroom and the loss path the run's config selects)."""

from __future__ import annotations

from megaframe.planning.published import RUNS
from tests.unit.planning import published_cache as cached


def test_memory_of_the_given_runs_is_within_the_band():
    rows = [cached.evaluate(r) for r in RUNS if r.published_gib]
    given = {e["name"]: round(e["memory_ratio"], 3) for e in rows if not e["held_out"]}
    assert given and all(0.85 <= v <= 1.15 for v in given.values()), given
    # the held-out run is reported, not fitted: planned under what it reserved (docs/planning.md says why)
    held = {e["name"]: round(e["memory_ratio"], 3) for e in rows if e["held_out"]}
    assert held and all(0.5 < v < 1.15 for v in held.values()), held
