"""The planner's figures for the published runs (planning.published), computed once per test session: the
page-table test, the band tests and the search test read the same pure computations (each run's plan takes
seconds), so each is made once and shared."""

from __future__ import annotations

import functools

from megaframe.planning import published

# the planner's own functions, bound now: a test may put the cached ones in their place in the module
evaluate = functools.cache(published.evaluate)
search_gap = functools.cache(published.search_gap)
