"""Take a folder (or one unit of work in it) for one writer at a time: a lock file created with O_EXCL that
names its owner, and a takeover of a stale lock that exactly one of several racing takers wins.

Creation: `os.open(O_CREAT | O_EXCL)`: of processes racing for a free lock exactly one creates the file.
It holds the owner's identity (host, pid, the pid's start time, the launcher's job id and restart count,
when, and a random token), written and fsynced before acquire() returns.

Takeover: the caller's policy says whether the observed holder is gone (a dead pid on this host, a Slurm
job reported finished, ...). Deciding may be slow (squeue), so it happens without any lock; the removal
does not. A taker then holds an exclusive flock on a sidecar (`<lock>.take`) and, under it, re-reads the
lock: only when it is still the very file it judged (same inode, same bytes) does it remove it and create
its own with O_EXCL. Nobody removes another's lock file outside that flock, so two takers that judged the
same stale file cannot both remove something: the second finds a different file (the winner's) and
judges again. Check-then-unlink without it let a slow taker delete the lock a fast one had just created,
and both wrote into one folder. After creating, the taker reads the file back and checks its token.
A file system without flock gets no takeover at all: the message says which file to remove by hand.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

StalePolicy = Callable[[dict | None, float], str | None]
"""(holder, None when unreadable; the lock file's age in s) -> why it is gone, or None while it may live."""


class _NoFlock(Exception):
    """The file system refuses flock (some network mounts): no takeover is safe there."""


class LockBusy(Exception):
    """The lock is held by an owner that may be alive (`holder`: its identity, or None while unreadable)."""

    def __init__(self, holder: dict | None, why: str = ""):
        super().__init__(why or describe(holder))
        self.holder = holder


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


def pid_start(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22), or None where unknown: a pid
    that is alive with another start time is a reused number, not the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def identity() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": pid_start(os.getpid()),
        "job": job_id(),
        "restart": restart_count(),
        "since": time.time(),
        "token": os.urandom(8).hex(),
    }


def pid_gone(holder: dict) -> str | None:
    """Why a holder on this host is gone (its pid exited, or the number now belongs to a newer process)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} on this host has exited"
    except PermissionError:  # exists, another user's
        pass
    started, recorded = pid_start(pid), holder.get("pid_start")
    if isinstance(recorded, int) and started is not None and started != recorded:
        return f"pid {pid} on this host has exited (the number now belongs to another process)"
    return None


def describe(h: dict | None) -> str:
    if h is None:
        return "another process (its lock file is being written or names no owner)"
    job = f", {h['job']}" if h.get("job") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0) or 0))
    return f"host {h.get('host')}, pid {h.get('pid')}{job}, since {since}"


def _read(path: Path) -> tuple[bytes, int] | None:
    """The lock file's bytes and inode, or None when there is none."""
    try:
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> dict | None:
    """The holder a lock file names, or None for one naming nobody: not JSON, or JSON without the identity
    every lock is written with (a host and a whole pid), which no policy could judge alive or gone: such a
    file counts as unreadable (stale once old, as a half-written one)."""
    try:
        h = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(h, dict):
        return None
    host, pid = h.get("host"), h.get("pid")
    named = isinstance(host, str) and host and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0
    return h if named else None


@contextlib.contextmanager
def _sidecar(path: Path):
    """An exclusive flock on `<path>.take`, removed (under the flock) when done. A taker blocked on a file
    the previous holder removed finds the path gone or a new file, and tries again on that."""
    side = path.with_name(path.name + ".take")
    while True:
        fd = os.open(side, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.stat(side)
        except FileNotFoundError:
            os.close(fd)
            continue
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise _NoFlock(str(e)) from None
            raise
        except BaseException:
            os.close(fd)
            raise
        if st.st_ino != os.fstat(fd).st_ino:
            os.close(fd)
            continue
        try:
            yield
        finally:
            side.unlink(missing_ok=True)
            os.close(fd)
        return


class OwnerLock:
    """A lock file naming its owner; acquire() raises LockBusy while a live (or undecided) owner holds it."""

    def __init__(self, path: str | Path, stale: StalePolicy, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.stale = stale
        # told why, once this process has taken over a stale lock
        self.warn = warn or (lambda why: print(f"megaframe: warning: took over {path} ({why})", flush=True))
        self.mine: dict | None = None

    @property
    def held(self) -> bool:
        return self.mine is not None

    def acquire(self) -> OwnerLock:
        for _ in range(20):  # each pass ends in a win, a live holder, or a file that changed while we judged
            if self._create():
                return self
            seen = _read(self.path)
            if seen is None:
                continue  # released between our create and our read
            holder = _parse(seen[0])
            why = self.stale(holder, self._age())
            if why is None:
                raise LockBusy(holder)
            if self._take_over(seen, why):
                return self
        raise LockBusy(None, f"{self.path} keeps changing hands; try again")

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _take_over(self, seen: tuple[bytes, int], why: str) -> bool:
        try:
            with _sidecar(self.path):
                if _read(self.path) != seen:
                    return False  # another taker was faster (or the owner came back): judge the new file
                self.path.unlink()
                won = self._create()
        except _NoFlock:
            holder = _parse(seen[0])
            raise LockBusy(
                holder,
                f"{describe(holder)}, which looks gone ({why}), but this file system "
                f"cannot lock a takeover; remove {self.path} by hand",
            ) from None
        if won:
            self.warn(why)
        return won

    def _create(self) -> bool:
        me = identity()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # read back: the file at the path is ours (nobody removes a fresh, readable lock of a live owner)
        back = _read(self.path)
        if back is None or (_parse(back[0]) or {}).get("token") != me["token"]:
            raise LockBusy(_parse(back[0]) if back else None, f"{self.path} was replaced while being taken")
        self.mine = me
        return True

    def holder(self) -> dict | None:
        seen = _read(self.path)
        return _parse(seen[0]) if seen else None

    def release(self) -> None:
        """Remove the lock file if it is still ours (by token)."""
        if self.mine is not None:
            if (self.holder() or {}).get("token") == self.mine["token"]:
                self.path.unlink(missing_ok=True)
            self.mine = None


class Moved(Exception):
    """The flocked file is no longer at its path: its folder was renamed away (published) or removed."""


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class SharedFlock:
    """A flock on a file inside a folder that may be renamed away (a partial folder being published): the
    kernel drops it when its holder dies, so it is never stale. Exclusive: one owner; shared: any number,
    until one of them asks for it exclusively (exclusive(): it waits for the others to leave). Holders note
    their identity in the file, so a refused process names one. After every wait the file is checked to
    still be the one at the path (else Moved): a process that waited while the folder was published must
    not take the lock of a folder that no longer exists, nor create one in its place."""

    def __init__(self, path: str | Path, shared: bool = False, wait: bool = False):
        self.path, self.shared = Path(path), shared
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)  # FileNotFoundError: no folder
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
            if not _same_file(fd, self.path):
                raise Moved(str(self.path))
        except BlockingIOError:
            os.close(fd)
            raise LockBusy(live_holder(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._note()

    def _note(self) -> None:
        if not self.shared:
            os.ftruncate(self.fd, 0)  # the sole owner: earlier holders' lines are history
        os.write(self.fd, (json.dumps(identity()) + "\n").encode())  # O_APPEND: sharers' lines never mix

    def exclusive(self, wait: bool = True) -> bool:
        """Become the only holder (waiting for the sharers to leave unless not `wait`); False when another
        still holds it; Moved when the folder went away meanwhile."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        if not _same_file(self.fd, self.path):
            raise Moved(str(self.path))
        self.shared = False
        self._note()
        return True

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def live_holder(path: Path) -> dict | None:
    """The newest holder noted in a SharedFlock's file that is not known to be gone."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for h in filter(None, map(lambda s: _parse(s.encode()), reversed(lines))):
        if h.get("host") != socket.gethostname() or pid_gone(h) is None:
            return h
    return None
