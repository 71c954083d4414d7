"""Submit pretrain.sbatch to the local cluster and watch the job (scontrol; no sacct without slurmdbd)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "pretrain.sbatch"
FINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def job_env(**extra: str) -> dict:
    """The submission environment: the venv's python first on PATH (the job runs `python`), wandb offline."""
    env = dict(os.environ)
    venv = ROOT / ".venv" / "bin"
    bindir = venv if (venv / "python").exists() else Path(sys.executable).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    for k in (
        "MEGAFRAME_RUN_NAME",
        "MEGAFRAME_LAUNCHER",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WANDB_DIR",
        "WANDB_API_KEY",
    ):
        env.pop(k, None)
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        MEGAFRAME_ROOT=str(ROOT),
        CUDA_VISIBLE_DEVICES="",
    )  # the CPU job on any host: train.device=auto must not pick a GPU
    env.update(extra)
    return env


def sbatch(flags: list[str], overrides: list[str], cwd: Path, **extra_env: str) -> int:
    res = subprocess.run(
        # the shipped script as it is: it asks for no GPUs, so the CPU-only local cluster takes it
        ["sbatch", "--parsable", *flags, str(SBATCH_SCRIPT), *overrides],
        cwd=cwd,
        env=job_env(**extra_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    return int(res.stdout.strip().split(";")[0])


def show(job: int) -> dict:
    """`scontrol show job` as a dict (JobState, Restarts, RunTime, ...); {} when unknown."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def seconds(runtime: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} not written)"


def wait_until(cond, timeout: float, what: str, job: int, out: Path, poll: float = 0.5):
    """Poll cond() until it returns something truthy; fails with the job's state and log on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    subprocess.run(["scancel", str(job)], capture_output=True)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}; job {job}: {show(job)}\n{tail(out)}"
    )


def wait_done(job: int, timeout: float, out: Path) -> dict:
    return wait_until(
        lambda: (info := show(job)).get("JobState") in FINAL and info,
        timeout,
        f"job {job} to finish",
        job,
        out,
    )


def count_lines(path: Path) -> int:
    try:
        return len(Path(path).read_text().splitlines())
    except OSError:
        return 0
