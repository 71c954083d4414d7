"""The step-time model's error against published runs, by kind of layout: what `plan` states with its answer.

The rows (published_runs.json: 52 published training runs, each as the overrides a user would type, its
device and world size, the published step time or what it follows from) are planned from the command line
by scripts/plan_published.py, whose table is docs/planning.md#published-runs. Per kind of layout the ratio
planned / published has a spread; RATIO_SPREAD holds its 10th and 90th percentiles, as that table gives
them (tests/unit/planning/test_plan_published.py recomputes them from the rows). `plan` turns a step time t
of a layout of kind k into the band t / hi .. t / lo: where four in five published runs of that kind landed
against this model's figure (`spread`: kinds with few rows get a wider band). It is a statement about
this model on those runs, not a confidence interval: few rows per kind (MoE 10, MoE with ep across nodes
3, cp 4) make it rough, and the table says how many.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROWS = Path(__file__).with_name("published_runs.json")
KINDS = ("dense", "moe", "moe (ep across nodes)", "cp", "small at large dp")
SMALL_PARAMS = 35e9
"""A model under this many parameters, on plain data parallelism (tp = pp = 1) over SMALL_DP ranks or more,
is 'small at large dp': its step is short, so fixed per-step costs (launches, collective latency, the
optimizer's pass) weigh most there."""
SMALL_DP = 64

RATIO_SPREAD = {
    "dense": (0.79, 1.123),
    "moe": (0.515, 0.877),
    "moe (ep across nodes)": (0.966, 1.164),
    "cp": (0.85, 1.116),
    "small at large dp": (0.842, 1.13),
}
"""Per kind, `spread` of planned / published over that kind's rows (module doc; the test recomputes it)."""
FEW = 3
"""A kind with fewer rows than this cannot give percentiles: its spread is its rows' range joined with
the 10th-90th percentile of all rows (the band is wider, never narrower, for what was seldom seen)."""


def load_rows() -> list[dict]:
    return json.loads(ROWS.read_text())


def layout_kind(
    num_experts: int, cp: int, tp: int, pp: int, dp: int, params: float, ep_across_nodes: bool = False
) -> str:
    """Which kind of layout a plan is, for its error band (module doc): moe before cp before the rest. An
    MoE layout whose expert group spans nodes is a kind of its own: its all-to-all crosses InfiniBand, the
    step's largest part there, and the published runs of it overlapped that exchange with another
    micro-batch's compute, which megaframe does not (docs/planning.md#published-runs)."""
    if num_experts:
        return "moe (ep across nodes)" if ep_across_nodes else "moe"
    if cp > 1:
        return "cp"
    if tp == pp == 1 and dp >= SMALL_DP and params < SMALL_PARAMS:
        return "small at large dp"
    return "dense"


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs, linear between the sorted values."""
    xs = sorted(xs)
    at = q * (len(xs) - 1)
    i = int(at)
    return xs[i] if i + 1 >= len(xs) else xs[i] + (at - i) * (xs[i + 1] - xs[i])


def summary(ratios: list[float]) -> dict:
    """median, median absolute error, range, the 10th / 90th percentile of planned / published, and the
    dispersion: the median of |ratio / median - 1|, the error left when a bias common to two layouts
    cancels (the search's tie band is sqrt(2) x it)."""
    med = statistics.median(ratios)
    return {
        "median": med,
        "dispersion": statistics.median(abs(r / med - 1) for r in ratios),
        "mae": statistics.median(abs(r - 1) for r in ratios),
        "lo": min(ratios),
        "hi": max(ratios),
        "p10": quantile(ratios, 0.1),
        "p90": quantile(ratios, 0.9),
        "n": len(ratios),
    }


def spread(kind_ratios: list[float], all_ratios: list[float]) -> tuple[float, float]:
    """(low, high) ratio of a kind: its 10th-90th percentile, or with fewer than FEW rows its range joined
    with all rows' 10th-90th percentile."""
    if len(kind_ratios) >= FEW:
        return quantile(kind_ratios, 0.1), quantile(kind_ratios, 0.9)
    every = (quantile(all_ratios, 0.1), quantile(all_ratios, 0.9))
    return min(*kind_ratios, every[0]), max(*kind_ratios, every[1])


def band(step_s: float, kind: str) -> tuple[float, float]:
    """(low, high) seconds a layout of `kind` planned at step_s took on published runs' evidence."""
    lo, hi = RATIO_SPREAD[kind]
    return step_s / hi, step_s / lo


def param_count(m) -> float:
    """The model's parameters, every expert's included (the family's counters, models/counts.py)."""
    from megaframe.models.registry import spec_of

    return spec_of(m).total_params(m)
