"""Ownership of a run folder: one job at a time writes into a `run.dir`.

Global rank 0 creates `${run.dir}/megaframe.lock` (megaframe.atomic_lock: O_EXCL, a race-free takeover)
before anything is written there; it holds the host, pid and job id of the owner and is removed when the
run ends. A second job given the same run.dir finds it and is refused (exit 2, naming the holder), so it
cannot replace the first job's checkpoints or metrics. The trainer takes one lock on run.dir and one on
checkpoint.dir (when it is another folder): two jobs with their own run.dir and one checkpoint.dir must not
replace each other's checkpoints. A lock is taken over only from a holder proven gone:
- on this host, by its pid alone (kill -9 leaves the file behind; the pid no longer exists), even when it
  names our own job id: two launches inside one Slurm allocation share SLURM_JOB_ID and are both alive;
- on another host, an earlier incarnation of our own job (the same SLURM_JOB_ID / TORCHELASTIC_RUN_ID with
  a lower restart count: a requeue or an elastic restart, whose old workers are gone);
- on another host, a Slurm job that squeue reports finished or unknown (taken over with a warning).
Any other holder is refused, and the message says which file to remove if that job is known to be gone.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from megaframe.atomic_lock import LockBusy, OwnerLock, describe, job_id, pid_gone, restart_count

__all__ = ["LOCK_NAME", "RunDirBusy", "RunLock", "holder_gone", "job_id", "restart_count", "slurm_job_gone"]

LOCK_NAME = "megaframe.lock"


class RunDirBusy(Exception):
    """Another live job owns the run folder; the message names it."""


# squeue's states of a job that will not run again
# (anything else, PENDING or RUNNING included, may still write)
_SLURM_DONE = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
    "SPECIAL_EXIT",
    "REVOKED",
}


def _ask(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def slurm_job_gone(job: str) -> str | None:
    """Why the Slurm job of a lock (`SLURM_JOB_ID=N`) is known to have ended, from squeue (else scontrol);
    None when it may still run or Slurm cannot be asked (no command, no answer): unknown is never dead."""
    if not job.startswith("SLURM_JOB_ID="):
        return None
    jid = job.split("=", 1)[1]
    if shutil.which("squeue"):
        out = _ask(["squeue", "-h", "-j", jid, "-o", "%T"])
        state = out.stdout.split() if out is not None else []
    elif shutil.which("scontrol"):
        out = _ask(["scontrol", "show", "job", "-o", jid])
        state = [
            w.split("=", 1)[1]
            for w in (out.stdout.split() if out is not None else [])
            if w.startswith("JobState=")
        ]
    else:
        return None
    if out is None:
        return None
    if out.returncode == 0 and state and state[0].rstrip("+") in _SLURM_DONE:
        return f"Slurm reports job {jid} {state[0]}"
    # a job purged from the controller's memory: both commands call it invalid
    if out.returncode != 0 and "invalid job id" in out.stderr.lower():
        return f"Slurm no longer knows job {jid}"
    return None


def holder_gone(holder: dict | None, age: float) -> str | None:
    """Why a lock's holder is gone (the lock may be taken over), or None while it may be alive: the
    policy of every megaframe.lock (atomic_lock.OwnerLock), also of the tools' locks."""
    if holder is None:
        # half-written by a taker that died at once, garbage, or naming no owner: stale only once it is old
        # 60 s: far longer than a taker needs from O_EXCL to its fsynced write: a live one is not robbed
        return "unreadable lock file" if age > 60 else None
    if holder.get("host") == socket.gethostname():
        # this host: the pid decides, whatever job id the lock names (one allocation runs several steps)
        return pid_gone(holder)
    mine, job = job_id(), str(holder.get("job") or "")
    restart = holder.get("restart")
    if mine and job == mine and isinstance(restart, int) and restart < restart_count():
        return f"an earlier run of this job {mine} (restart {restart}, now {restart_count()})"
    if job and job != mine:
        return slurm_job_gone(job)
    return None


class RunLock:
    """One writer of a folder. beside=True keeps the lock out of the folder (`.NAME.lock` next to it), for
    a folder replaced whole at the end (export_hf's output)."""

    def __init__(self, run_dir: str | Path, key: str = "run.dir", beside: bool = False):
        self.folder = Path(run_dir)
        self.path = self.folder.with_name(f".{self.folder.name}.lock") if beside else self.folder / LOCK_NAME
        self.key = key  # the config key the folder came from, for the messages
        self.lock = OwnerLock(
            self.path,
            holder_gone,
            warn=lambda why: print(
                f"megaframe: warning: taking over the lock of {self.key}={self.folder} ({why})", flush=True
            ),
        )

    @property
    def held(self) -> bool:
        return self.lock.held

    def acquire(self) -> RunLock:
        """Take the lock, or raise RunDirBusy naming the live holder (one taker wins a stale one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire()
        except LockBusy as e:
            raise RunDirBusy(
                self._busy(e.holder) if str(e) == describe(e.holder) else f"{self.key}={self.folder}: {e}"
            ) from None
        return self

    def _busy(self, h: dict | None) -> str:
        if h is None:
            return (
                f"{self.key}={self.folder} is locked by another job ({self.path} is being written, or names "
                "no owner: it is taken over once a minute old; remove it if no run is starting there)"
            )
        return (
            f"{self.key}={self.folder} is in use by another run ({describe(h)}); pick another "
            f"{self.key}, or remove {self.path} if that run is gone"
        )

    def release(self) -> None:
        self.lock.release()  # only our own file (by token): a job that took over a stale lock keeps it
