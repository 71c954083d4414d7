"""Layout search: the candidates (search/candidates.py) sized in every phase (memory/dims.py; a layout any
phase of which is over the memory is dropped), timed by the stated model of steptime/timing.py (compute, each
axis's communication, the bubble), ranked: the tie band first, ordered by what the plan knows best."""

from __future__ import annotations

from dataclasses import dataclass, field

from megaframe.config import Config
from megaframe.planning.candidate import Layout
from megaframe.planning.devices import Device
from megaframe.planning.memory.dims import phase_memory
from megaframe.planning.search.candidates import Ticker, candidates
from megaframe.planning.steptime.timing import step_time

HEADROOM = 0.9
"""Fraction of the device memory a layout may fill."""


MODEL_ERROR = 0.15
"""The search's tie band: sqrt(2) x the step-time model's dispersion on published training runs (the median
of |ratio / median ratio - 1| over planning/published_runs.json, docs/planning.md's table from
scripts/plan_published.py, held by tests/unit/planning/test_plan_published.py): the typical error of the
ratio of two estimates, whose common bias cancels. Layouts closer than this to the fastest are ties."""


@dataclass
class Estimate:
    layout: Layout
    memory_bytes: int
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, tp, ep, pp, dp, bubble (the bubble's share of the stretched time)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak bytes of the largest rank per phase (planning.memory.phases); memory_bytes is their maximum."""

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "memory_bytes": self.memory_bytes,
            "phases": self.phases,
            "step_s": self.step_s,
            "parts_s": self.parts,
        }


def search(
    cfg: Config, world: int, dev: Device, memory_bytes: float | None, progress=None, keep=None
) -> tuple[list[Estimate], int, int]:
    """(fitting estimates, the tie group first (break_ties), then by time; candidates; dropped for memory).
    `progress(text)` hears how far it got every few seconds (the command prints it to stderr); `keep`
    narrows the candidates (candidates())."""
    import time

    # 10 % of a device is kept back for the CUDA context, NCCL buffers and allocator fragmentation
    cap = HEADROOM * (memory_bytes if memory_bytes is not None else dev.memory_gb * 2**30)
    out, dropped, t0 = [], 0, time.perf_counter()
    say = progress or (lambda text: None)
    say("search: enumerating and validating layouts")
    cands = candidates(cfg, world, dev.per_node if not dev.name.startswith("cpu") else world, keep, say)
    # the first layouts of a shape build its meta-device activation tables (seconds each): say so first
    say(f"search: {len(cands)} valid layouts; sizing and timing them")
    ticker = Ticker(say, "sized and timed", len(cands))
    for i, lay in enumerate(cands, 1):
        ticker.tick(i, f", {len(out)} fit")
        phases = phase_memory(cfg, lay)
        mem = max(phases.values())
        if cap and mem > cap:
            dropped += 1
            continue
        out.append(Estimate(lay, mem, step_time(cfg, lay, dev, world), phases))
    out.sort(key=lambda e: (e.step_s, e.memory_bytes))
    say(f"search: {len(cands)} layouts in {time.perf_counter() - t0:.0f}s")
    return break_ties(out), len(cands), dropped


def axes_used(lay: Layout) -> int:
    """Parallel axes a layout uses beyond plain data parallelism, and its optional features: fewer is
    simpler to run and to debug."""
    return (
        sum(x > 1 for x in (lay.tp, lay.cp, lay.pp, lay.vpp, lay.ep))
        + (lay.zero >= 2)
        + bool(lay.shard)
        + (lay.grad_dtype != "fp32")
        + bool(lay.schedule)
        + (lay.recompute != "none")
    )


def break_ties(ests: list[Estimate], error: float = MODEL_ERROR) -> list[Estimate]:
    """The layouts within the model's error of the fastest ordered by memory headroom (least peak memory
    first, in whole GiB: a few MiB is no headroom anyone can use), then simplicity (axes_used), then time;
    the rest stay by time."""
    k = ties(ests, error)
    head = sorted(ests[:k], key=lambda e: (round(e.memory_bytes / 2**30), axes_used(e.layout), e.step_s))
    return head + ests[k:]


def ties(ests: list[Estimate], error: float = MODEL_ERROR) -> int:
    """How many layouts are within the model's error of the fastest (the tie group, first in the ranking)."""
    if not ests:
        return 0
    best = min(e.step_s for e in ests)
    return sum(1 for e in ests if e.step_s <= best * (1 + error))


def why_slower(e: Estimate, best: Estimate) -> str:
    """The part that costs this layout the most against the first, in words."""
    diffs = {k: e.parts[k] - best.parts.get(k, 0.0) for k in e.parts}
    k = max(diffs, key=diffs.get)
    what = {
        "compute": "more compute (recompute)",
        "tp": "tp communication",
        "ep": "expert all-to-all",
        "cp": "context-parallel K/V exchange",
        "bubble": "pipeline bubble",
        "pp": "pipeline p2p",
        "dp": "data-parallel grad/param traffic",
    }[k]
    return f"+{100 * (e.step_s / best.step_s - 1):.1f}%: {what} +{diffs[k] * 1e3:.1f} ms"
