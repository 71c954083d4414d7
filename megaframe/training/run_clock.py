"""This incarnation's clock for the goodput figures (runops/goodput_account.py): where its wall time
goes, written on every metrics row as `clock/*`, with `goodput/*` summed over the folder's earlier
incarnations (read once from metrics.jsonl at start-up) and this one."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from megaframe.runops import goodput_account as goodput

STARTUP_PHASES = ("process", "setup", "loop")
"""process: the process's start (under Slurm the job's, when earlier) to train(): imports, the process
group, the mesh, the run folder's locks; setup: model, optimizer, data and the resume's load; loop: the
header, the tracker (wandb) and the checkpointer, up to the first step."""


def process_start() -> float:
    """Unix time this process started (else now), or the Slurm job's start when that is earlier
    and within the hour (an srun step started long after its allocation is not this start-up's)."""
    start = time.time() - process_age()
    job = os.environ.get("SLURM_JOB_START_TIME", "")
    if job.isdigit() and 0 <= start - int(job) < 3600:
        start = float(job)
    return start


def process_age() -> float:
    """Seconds since this process started, from /proc (10 ms ticks; psutil's create_time adds the boot time,
    known to the second only, and put a restart before its predecessor's last row); 0 off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class RunClock:
    """Seconds of this incarnation per bucket; `row(step)` the clock and goodput fields of a metrics row."""

    def __init__(self, run_id: str, start: float | None = None):
        """Made as train() begins: the `process` phase ends here."""
        # a caller without a run id (a test's direct train()) still gets incarnations told apart
        self.run_id, self.start_step = run_id or f"pid{os.getpid()}@{time.time():.3f}", 0
        self.start = process_start() if start is None else start
        self.counters = dict.fromkeys(goodput.COUNTERS, 0.0)
        self.phases: dict[str, float] = {}
        self.startup = None
        self._mark = self.start
        self.prior: list = []
        self.phase("process")

    def resumed(self, start_step: int, run_dir: str, logger: bool) -> None:
        """Start-up knows the step it resumes from; the logger reads the earlier incarnations once."""
        self.start_step = start_step
        if logger and (Path(run_dir) / "metrics.jsonl").is_file():
            self.prior = goodput.from_rows(goodput.read_rows(run_dir))

    def phase(self, name: str) -> None:
        """The start-up phase `name` ended now (it began where the previous one ended, or at the start)."""
        now = time.time()
        self.phases[name] = now - self._mark
        self._mark = now

    def first_step(self) -> None:
        if self.startup is None:
            self.phase("loop")
            self.startup = time.time() - self.start

    @contextmanager
    def timing(self, counter: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.counters[counter] += time.perf_counter() - t0

    def row(self, step: int, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        clock = {
            "clock/run_id": self.run_id,
            "clock/start": self.start,
            "clock/start_step": self.start_step,
            "clock/startup_s": self.startup or 0.0,
            **{f"clock/startup/{k}_s": v for k, v in self.phases.items()},
            **{f"clock/{v}": self.counters[k] for k, v in goodput.COUNTERS.items()},
        }
        # this incarnation is the newest: nothing after it undid its steps, so its own rows are not needed
        mine = goodput.from_rows([{**clock, "time": now, "step": step}])
        return {**clock, **goodput.account([*self.prior, *mine])}


def summary(figures: dict) -> str:
    """The goodput part of the run's closing line."""
    if "goodput/fraction" not in figures:
        return ""
    parts = ", ".join(
        f"{k} {figures[f'goodput/{k}_s']:.1f}s"
        for k in ("startup", "data_wait", "checkpoint", "eval", "lost_progress", "gap")
        if figures[f"goodput/{k}_s"] >= 0.05
    )
    return (
        f" | goodput {100 * figures['goodput/fraction']:.1f}%: productive "
        f"{figures['goodput/productive_s']:.1f}s of {figures['goodput/wall_s']:.1f}s wall"
        f"{' (' + parts + ')' if parts else ''}"
    )
