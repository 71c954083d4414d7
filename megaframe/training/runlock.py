"""Ownership of a run folder: one job at a time writes into a `run.dir`.

Global rank 0 creates `${run.dir}/megaframe.lock` with O_EXCL before anything is written there; it holds
the host, pid and job id of the owner and is removed when the run ends. A second job given the same
run.dir finds it and is refused (exit 2, naming the holder), so it cannot replace the first job's
checkpoints or metrics. A lock is taken over when its holder is gone:
- the same job (Slurm requeue, torchrun restart: same SLURM_JOB_ID / TORCHELASTIC_RUN_ID), on any host;
- a dead process on this host (kill -9 leaves the file behind; the pid no longer exists).
A holder on another host cannot be checked from here: it is refused, and the message says which file to
remove if that job is known to be gone.
"""
from __future__ import annotations

import json
import os
import socket
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def me(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time()}

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
                print(f"megaframe: taking over the lock of run.dir={self.path.parent} ({why})", flush=True)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me()) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise RunDirBusy(f"run.dir={self.path.parent} is being locked by another job at the same time ({self.path})")

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
        mine = job_id()
        if mine and holder.get("job") == mine:
            return f"same job {mine}, restarted"
        if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", -1))):
            return f"pid {holder.get('pid')} on this host has exited"
        return None

    def _busy(self, h: dict | None) -> str:
        if h is None:
            return f"run.dir={self.path.parent} is locked by another job ({self.path} is being written)"
        job = f", {h['job']}" if h.get("job") else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
        return (f"run.dir={self.path.parent} is in use by another run (host {h.get('host')}, pid {h.get('pid')}"
                f"{job}, since {since}); pick another run.dir, or remove {self.path} if that run is gone")

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            # only our own file: a job that took over a stale lock keeps it
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False
