"""Goodput: where a run's wall time went, over every incarnation of its folder, from its own files.

Each metrics row the logging rank writes carries its incarnation's clock (training/run_clock.py):
`clock/run_id` (this launch), `clock/start` (unix time the process started; under Slurm the job step's
start when earlier), `clock/start_step` (the step it resumed from, 0 fresh), and the seconds it spent so
far in start-up (`clock/startup_s`, and per phase `clock/startup/<phase>_s`), in steps (`clock/step_s`),
waiting for batches (`clock/data_wait_s`), blocked on checkpoint saves (`clock/checkpoint_s`) and in
validation, sampling and downstream scoring (`clock/eval_s`). Rows are appended over restarts, so the
file holds every incarnation in order. From them, with `time` (unix seconds of the row):

  productive_s     step time that stayed in the model
  startup_s        process start to the first step, per phase
  data_wait_s      waiting for the step's batches
  checkpoint_s     blocked in checkpoint saves (a background write's own time is not blocking)
  eval_s           validation, samples and in-loop downstream scoring
  lost_progress_s  step time of the steps an incarnation trained past the step the next one resumed from
                   (trained after its last committed checkpoint, then lost): interpolated between its
                   logged rows
  gap_s            from an incarnation's last row to the next one's start: the restart, a Slurm requeue's
                   queue wait, and any steps a dying process trained after its last row (unlogged)
  other_s          the rest of the wall (logging, the loop's own work)
  fraction         productive_s over the wall, the first start to the last row

Rows without a clock (written before it existed) are left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BUCKETS = ("productive", "startup", "data_wait", "checkpoint", "eval", "lost_progress", "gap")
COUNTERS = {"step": "step_s", "data_wait": "data_wait_s", "checkpoint": "checkpoint_s", "eval": "eval_s"}


@dataclass
class Incarnation:
    """One launch of the run, as its last row (so far) tells."""

    run_id: str
    start: float
    start_step: int
    end: float = 0.0
    last_step: int = 0
    startup: float = 0.0
    phases: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    points: list = field(default_factory=list)
    """(step, cumulative step seconds) of each row, for the step time up to any step."""

    def step_s_at(self, step: int) -> float:
        """Cumulative step seconds when `step` was done (linear between logged rows)."""
        pts = [(self.start_step, 0.0), *self.points]
        if step <= pts[0][0]:
            return 0.0
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if s0 < step <= s1:
                return t0 + (t1 - t0) * (step - s0) / max(1, s1 - s0)
        return pts[-1][1]


def from_rows(rows: list[dict]) -> list[Incarnation]:
    """The incarnations of metrics rows in file order (rows without a clock skipped)."""
    out: dict[str, Incarnation] = {}
    for r in rows:
        rid = r.get("clock/run_id")
        if not rid:
            continue
        inc = out.get(rid)
        if inc is None:
            inc = out[rid] = Incarnation(rid, float(r["clock/start"]), int(r.get("clock/start_step", 0)))
        inc.end, inc.last_step = float(r["time"]), int(r["step"])
        inc.startup = float(r.get("clock/startup_s", 0.0))
        inc.phases = {k.split("/")[-1][:-2]: v for k, v in r.items() if k.startswith("clock/startup/")}
        inc.counters = {k: float(r.get(f"clock/{v}", 0.0)) for k, v in COUNTERS.items()}
        inc.points.append((inc.last_step, inc.counters["step"]))
    return sorted(out.values(), key=lambda i: i.start)


def account(incs: list[Incarnation]) -> dict:
    """goodput/<bucket>_s, goodput/startup/<phase>_s, goodput/other_s, goodput/wall_s,
    goodput/incarnations and goodput/fraction over `incs` (in start order); {} when there are none."""
    if not incs:
        return {}
    tot = dict.fromkeys(BUCKETS, 0.0)
    phases: dict[str, float] = {}
    for i, inc in enumerate(incs):
        nxt = incs[i + 1] if i + 1 < len(incs) else None
        steps = inc.counters.get("step", 0.0)
        # the next start resumed before this one's last step: the steps in between were trained twice
        lost = steps - inc.step_s_at(nxt.start_step) if nxt and nxt.start_step < inc.last_step else 0.0
        tot["productive"] += steps - lost
        tot["lost_progress"] += lost
        tot["startup"] += inc.startup
        for k in ("data_wait", "checkpoint", "eval"):
            tot[k] += inc.counters.get(k, 0.0)
        for k, v in inc.phases.items():
            phases[k] = phases.get(k, 0.0) + v
        if nxt is not None:
            tot["gap"] += max(0.0, nxt.start - inc.end)
    wall = max(1e-9, incs[-1].end - incs[0].start)
    row = {f"goodput/{k}_s": v for k, v in tot.items()}
    row.update({f"goodput/startup/{k}_s": v for k, v in phases.items()})
    row["goodput/other_s"] = max(0.0, wall - sum(tot.values()))
    row["goodput/wall_s"] = wall
    row["goodput/incarnations"] = len(incs)
    row["goodput/fraction"] = tot["productive"] / wall
    return row


def read_rows(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl's rows in file order (every incarnation's; a torn last line skipped); ValueError
    naming the folder when there is no metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run folder)")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"clock/run_id"' not in line:  # a row without a clock: not parsed at all
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:  # the last line of a process killed while writing it
                continue
    return rows


def of_folder(run_dir: str | Path) -> dict:
    """The goodput figures of a run folder (finished or running); ValueError when it has no clocked row."""
    rows = read_rows(run_dir)
    try:
        incs = from_rows(rows)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{run_dir}: metrics.jsonl holds a malformed clock row ({e})") from e
    if not incs:
        raise ValueError(f"{run_dir}: metrics.jsonl holds no row with a goodput clock")
    return account(incs)


def table(figures: dict) -> str:
    """The figures as lines: bucket, seconds, share of the wall."""
    wall = figures["goodput/wall_s"]
    lines = [f"{'bucket':<22}{'seconds':>10}{'share':>8}"]
    for k in (*BUCKETS, "other"):
        v = figures[f"goodput/{k}_s"]
        lines.append(f"{k + '_s':<22}{v:>10.2f}{100 * v / wall:>7.1f}%")
        if k == "startup":
            for name, p in sorted((n, x) for n, x in figures.items() if n.startswith("goodput/startup/")):
                lines.append(f"  {name.split('/')[-1]:<20}{p:>10.2f}")
    lines.append(f"{'wall_s':<22}{wall:>10.2f}  over {figures['goodput/incarnations']} incarnation(s)")
    lines.append(f"{'fraction':<22}{figures['goodput/fraction']:>10.3f}")
    return "\n".join(lines)
