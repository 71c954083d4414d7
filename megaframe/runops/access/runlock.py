"""Ownership of a run folder: one job at a time writes into a `run.dir`.

Global rank 0 creates `${run.dir}/megaframe.lock` with O_EXCL before anything is written there; it holds
the host, pid and job id of the owner and is removed when the run ends. A second job given the same
run.dir finds it and is refused (exit 2, naming the holder), so it cannot replace the first job's
checkpoints or metrics. The trainer takes one lock on run.dir and one on checkpoint.dir (when it is
another folder): two jobs with their own run.dir and one checkpoint.dir must not replace each other's
checkpoints. A lock is taken over only from a holder proven gone:
- on this host, by its pid alone (kill -9 leaves the file behind; the pid no longer exists), even when it
  names our own job id: two launches inside one Slurm allocation share SLURM_JOB_ID and are both alive;
- on another host, an earlier incarnation of our own job (the same SLURM_JOB_ID / TORCHELASTIC_RUN_ID with
  a lower restart count: a requeue or an elastic restart, whose old workers are gone);
- on another host, a Slurm job that squeue reports finished or unknown (taken over with a warning).
Any other holder is refused, and the message says which file to remove if that job is known to be gone.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

LOCK_NAME = "megaframe.lock"


class RunDirBusy(Exception):
    """Another live job owns the run folder; the message names it."""


def job_id() -> str:
    """The launcher's job id, stable across restarts of the same job ("" outside a launcher)."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var, "")
        if v and v != "none":
            return f"{var}={v}"
    return ""


def restart_count() -> int:
    """How many times the launcher restarted this job (Slurm requeues, torchelastic restarts): an earlier
    incarnation of the same job has a lower count."""
    n = 0
    for var in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        try:
            n += int(os.environ.get(var, "0") or 0)
        except ValueError:
            pass
    return n


# squeue's states of a job that will not run again (anything else, PENDING or RUNNING included, may still write)
_SLURM_DONE = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
               "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT", "REVOKED"}


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
        state = [w.split("=", 1)[1] for w in (out.stdout.split() if out is not None else []) if w.startswith("JobState=")]
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str | Path, key: str = "run.dir"):
        self.path = Path(run_dir) / LOCK_NAME
        self.key = key  # the config key the folder came from, for the messages
        self.held = False

    def me(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "restart": restart_count(),
                "since": time.time()}

    def acquire(self) -> RunLock:
        """Take the lock, or raise RunDirBusy naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a racing taker may remove a stale file between our tries
            try:
                # O_EXCL: of two jobs racing for the folder exactly one creates the file
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                why = self._stale(holder)
                if why is None:
                    raise RunDirBusy(self._busy(holder)) from None
                print(f"megaframe: warning: taking over the lock of {self.key}={self.path.parent} ({why})", flush=True)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me()) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise RunDirBusy(f"{self.key}={self.path.parent} is being locked by another job at the same time ({self.path})")

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict | None) -> str | None:
        """Why the holder is gone (the lock may be taken over), or None while it may be alive."""
        if holder is None:
            # half-written by a taker that died at once, or garbage: stale only once it is old
            age = time.time() - self.path.stat().st_mtime if self.path.exists() else 1e9
            # 60 s: far longer than a taker needs between O_EXCL and its fsynced write, so a live one is not robbed
            return "unreadable lock file" if age > 60 else None
        if holder.get("host") == socket.gethostname():
            # this host: the pid decides, whatever job id the lock names (one allocation runs several steps)
            pid = holder.get("pid")
            if isinstance(pid, int) and not _alive(pid):
                return f"pid {pid} on this host has exited"
            return None
        mine, job = job_id(), str(holder.get("job") or "")
        restart = holder.get("restart")
        if mine and job == mine and isinstance(restart, int) and restart < restart_count():
            return f"an earlier run of this job {mine} (restart {restart}, now {restart_count()})"
        if job and job != mine:
            return slurm_job_gone(job)
        return None

    def _busy(self, h: dict | None) -> str:
        if h is None:
            return f"{self.key}={self.path.parent} is locked by another job ({self.path} is being written)"
        job = f", {h['job']}" if h.get("job") else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
        return (f"{self.key}={self.path.parent} is in use by another run (host {h.get('host')}, pid {h.get('pid')}"
                f"{job}, since {since}); pick another {self.key}, or remove {self.path} if that run is gone")

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            # only our own file: a job that took over a stale lock keeps it
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False
