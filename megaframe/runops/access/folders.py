"""The folders a run writes (run.dir: metrics, config, samples, hang reports, NCCL traces; checkpoint.dir:
checkpoints), checked and owned before the first step.

Each is created and probed with a real file at start (global rank 0): an uncreatable or read-only folder is
bad input found in a second (exit 2, one line naming the key and the path), not a traceback at the first
save hours in. Then each is locked (runops/access/runlock.py): checkpoint.dir too when it is not run.dir, so
two jobs with their own run.dir and one checkpoint.dir cannot replace each other's checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path

from megaframe.config.schema import CheckpointConfig, LoggingConfig, RunConfig
from megaframe.errors import ConfigError
from megaframe.runops.access.runlock import RunDirBusy, RunLock

TENSORBOARD_DIR = "logging.tensorboard.dir"


def written(
    run: RunConfig, ckpt: CheckpointConfig, logs: LoggingConfig | None = None
) -> list[tuple[str, str]]:
    """(config key, folder) of everything a run writes; the subfolders of run.dir (samples, hang/,
    nccl_trace/) are probed through it, TensorBoard's event folder (which may be anywhere) on its own."""
    tb = [(TENSORBOARD_DIR, logs.tensorboard.dir)] if logs is not None and logs.tensorboard.enabled else []
    return [("run.dir", run.dir), ("checkpoint.dir", ckpt.dir), *tb]


def check_names(run: RunConfig, ckpt: CheckpointConfig, logs: LoggingConfig | None = None) -> None:
    """No process group, no file system writes: an empty folder name (`run.dir=$RUN_DIR` with the
    variable unset) would put checkpoints at /checkpoints and the lock in the current directory."""
    for key, value in written(run, ckpt, logs):
        if not str(value).strip():
            raise ConfigError(f"{key}={value!r} must not be empty (an unset shell variable?)")
    if not str(run.dir).strip("/"):
        raise ConfigError(f"run.dir={run.dir!r} is the file system root; name a run folder")
    _check_run_name(str(run.name))
    for key, value in written(run, ckpt, logs):
        # the file system's limit on one name (NAME_MAX): a longer one was an OSError traceback at start-up
        if any(len(part.encode()) > 255 for part in Path(value).parts):
            raise ConfigError(f"{key}={value}: a folder name longer than 255 bytes (the file system's limit)")
    for key, value in written(run, ckpt, logs):
        # a folder below an existing plain file can never be created: refused before any rank starts
        for parent in [Path(value), *Path(value).parents]:
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"{key}={value}: {parent} is a file, not a folder")
                break


def _check_run_name(name: str) -> None:
    """run.name names the run (its default folder outputs/<run.name>, its wandb name): an empty one put the
    run's files into outputs/ itself, beside every other run's folder, and a `..` part wrote outside it."""
    if not name.strip():
        raise ConfigError(f"run.name={name!r} must not be empty (an unset shell variable?)")
    if ".." in Path(name).parts:
        raise ConfigError(
            f"run.name={name}: a `..` part leaves the outputs folder; name the run or set run.dir"
        )


def probe(key: str, folder: str | Path) -> None:
    """Create `folder` and write (then remove) a file in it; ConfigError naming the key when impossible."""
    path = Path(folder)
    test = path / f".megaframe-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        test.write_bytes(b"")
        test.unlink()
    except OSError as e:
        raise ConfigError(
            f"{key}={folder}: cannot write there ({e.strerror or type(e).__name__}: {e.filename or path})"
        ) from None


def pointer_files(folder: str | Path) -> None:
    """`latest` and `latest.tmp` must be files (or absent): the first save replaces them, and a folder
    there would end the run with a traceback after its first checkpoint was written (checked up front)."""
    for name in ("latest", "latest.tmp"):
        path = Path(folder) / name
        if path.is_dir():  # also a link to a folder
            raise ConfigError(
                f"checkpoint.dir={folder}: {path} is a folder, not the `{name}` pointer file a "
                "save writes; move it away (or pick another checkpoint.dir)"
            )


class FolderLocks:
    """The run's locks, released together."""

    def __init__(self):
        self.locks: list[RunLock] = []
        self.created: list[Path] = []  # checkpoint folders this run created (for its lock) before any save
        self.owner = ""  # this run's id (runops/access/owner.py), recorded in every checkpoint it writes

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        for folder in self.created:
            try:  # a run that saved nothing leaves no empty checkpoint folder behind, as before the lock
                folder.rmdir()
            except OSError:
                pass


BAD_INPUT = "megaframe.bad_input"
"""${run.dir}/megaframe.bad_input: the one line of the first rank that found bad input mid-run (a corrupt
shard only the rank reading it sees). That rank exits 2; its peers then fail inside a collective, find
this line and exit 2 with it too, so every rank says the same thing, with no per-step agreement."""


def record_bad_input(run_dir: str, line: str) -> str:
    """Write the line before this rank raises and its exit breaks the peers' collectives; returns the line
    to end with: the first writer's (O_EXCL), so ranks that each found a corrupt shard still agree. An
    unwritable run.dir only loses the peers' copy of the message."""
    try:
        fd = os.open(Path(run_dir) / BAD_INPUT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
    except FileExistsError:
        return peer_bad_input(run_dir) or line
    except OSError:
        pass
    return line


def peer_bad_input(run_dir: str) -> str | None:
    """The line a peer recorded in this run, or None."""
    try:
        return (Path(run_dir) / BAD_INPUT).read_text().strip() or None
    except OSError:
        return None


def claim(run: RunConfig, ckpt: CheckpointConfig, logs: LoggingConfig | None = None) -> FolderLocks:
    """Probe and lock every folder the run writes (rank 0 only); ConfigError naming the first problem.
    run.dir first: a refused second job then creates nothing in a shared checkpoint folder."""
    held, seen = FolderLocks(), set()
    try:
        for key, folder in written(run, ckpt, logs):
            if key == "checkpoint.dir" and not Path(folder).exists():
                held.created.append(Path(folder))
            probe(key, folder)
            # written only by the run that holds run.dir's lock: no lock of its own
            if key == TENSORBOARD_DIR:
                continue
            if key == "checkpoint.dir":
                pointer_files(folder)
            real = Path(folder).resolve()
            if real in seen:  # checkpoint.dir=run.dir: one lock
                continue
            seen.add(real)
            try:
                held.locks.append(RunLock(folder, key).acquire())
            except RunDirBusy as e:
                raise ConfigError(str(e)) from None
            except OSError as e:
                raise ConfigError(f"{key}={folder}: cannot take the run lock ({e})") from None
    except ConfigError:
        held.release()
        raise
    # a line left by an earlier launch is not this run's (the lock makes us the only writer now)
    (Path(run.dir) / BAD_INPUT).unlink(missing_ok=True)
    return held
