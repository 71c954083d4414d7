"""Measured search (`python -m megaframe.plan ... +search=true +measure=K`): the top K ranked layouts each
train a few steps on this machine and are re-ranked by their measured step time.

A run is train.py under torchrun (world_size processes on this node) with the user's overrides plus the
layout's, in a temporary run folder (its checkpoints there too, never the user's), checkpoint.resume=none and
train.log_interval=1. Its step time is read as scripts/validate_planner.py reads it: tokens per step over
tokens_per_s of each metrics.jsonl row after the first two (start-up, compilation), the fastest step (the one
least disturbed by other processes). A layout that fails to run is reported with its first error line and
ranked last: the search's memory model, not this machine, decides what fits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WARMUP_ROWS = 2


@dataclass
class Measured:
    rank: int
    """The layout's place in the predicted ranking (1 = first)."""
    estimate: object
    step_s: float | None
    error: str | None = None


def step_seconds(run_dir: Path, tokens_per_step: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("tokens_per_s")]
    timed = rows[WARMUP_ROWS:] or rows[-1:]
    if not timed:
        raise ValueError(f"{run_dir}: no timed steps in metrics.jsonl")
    return min(tokens_per_step / r["tokens_per_s"] for r in timed)


def run_layout(
    overrides: list[str], layout, world: int, steps: int, run_dir: Path, tokens: int, timeout_s: float = 600
) -> float:
    """Step time of the layout trained `steps` steps here; RuntimeError with the run's last error line."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's workers share the cores
    env.pop("MEGAFRAME_RUN_NAME", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(ROOT / "train.py"),
        *overrides,
        *layout.overrides(),
        f"train.max_steps={steps}",
        "train.log_interval=1",
        f"run.dir={run_dir}",
        f"checkpoint.dir={run_dir}/checkpoints",
        "checkpoint.resume=none",
        "logging.wandb.mode=disabled",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if "error" in ln.lower()]
        lines = lines or res.stderr.splitlines() or ["?"]
        raise RuntimeError(f"exit {res.returncode}: {lines[-1].strip()[:200]}")
    return step_seconds(run_dir, tokens)


def measure(
    cfg, overrides: list[str], ests: list, k: int, world: int, steps: int, progress=print
) -> list[Measured]:
    """The top k estimates, each measured; ordered by measured step time (failed runs last)."""
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    out = []
    with tempfile.TemporaryDirectory(prefix="megaframe_measure_") as tmp:
        for i, est in enumerate(ests[:k], 1):
            progress(f"measure: #{i} {est.layout.label()}: {steps} steps on {world} local processes")
            try:
                s = run_layout(overrides, est.layout, world, steps, Path(tmp) / f"layout{i}", tokens)
                out.append(Measured(i, est, s))
            except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                out.append(Measured(i, est, None, str(e).splitlines()[0]))
    return sorted(out, key=lambda m: (m.step_s is None, m.step_s or 0.0, m.rank))


def report(rows: list[Measured], steps: int) -> str:
    """The measured ranking beside the predicted one."""
    lines = [
        f"measured ({steps} steps each on this machine, fastest step after the first {WARMUP_ROWS}; "
        "timings on a shared machine are noisy):",
        f"{'measured':>8} {'predicted':>9}  {'layout':<74} {'measured':>10} {'predicted':>10} {'error':>7}",
    ]
    for n, m in enumerate(rows, 1):
        pred = m.estimate.step_s
        if m.step_s is None:
            lines.append(
                f"{'-':>8} {'#' + str(m.rank):>9}  {m.estimate.layout.label():<74} {'failed':>10} "
                f"{pred:>9.3f}s  {m.error}"
            )
            continue
        lines.append(
            f"{'#' + str(n):>8} {'#' + str(m.rank):>9}  {m.estimate.layout.label():<74} "
            f"{m.step_s:>9.3f}s {pred:>9.3f}s {100 * (pred / m.step_s - 1):>+6.1f}%"
        )
    ok = [m for m in rows if m.step_s is not None]
    if ok:
        lines.append("run the measured #1 with: " + " ".join(ok[0].estimate.layout.overrides()))
    return "\n".join(lines)
