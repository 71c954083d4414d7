"""Who may write the hidden partial folder `.OUT.partial` of a prepare, and how it becomes OUT.

Every prepare of one OUT (a plain run, any task of any data.num_tasks, a merge) holds the folder's `.lock`
(megaframe.atomic_lock.SharedFlock) for as long as it works there: a plain run exclusively (a second
prepare of the same OUT, plain or task, exits 2 naming it), tasks and merges shared. Tasks of different
splits (task 1 of 2 beside task 2 of 4) may own the same unit, so a unit is written under its own lock
(`units/unit_K.lock`): the first to take it tokenizes it, the others wait their turn, then find its record
and skip it. Only the holder of a unit's lock removes that unit's leftover shards (an interrupted run's),
and a unit with a record is never redone while its files are unchanged, so no process deletes shards
another recorded. Publishing takes `.lock` exclusively (the other tasks leave first), checks that every
shard meta.json names is there with its size, and renames the folder into place. A process that waited
while another published finds the lock file gone from its path (Moved) and reports the work as done.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from megaframe.atomic_lock import LockBusy, Moved, SharedFlock, describe
from megaframe.data.prepare import manifest as mf
from megaframe.data.prepare.sources import PrepareError

LOCK = ".lock"


def enter(work: Path, tasked: bool) -> SharedFlock:
    """Hold the partial folder: exclusively for a plain run, shared for a task or merge. Raises
    FileNotFoundError or Moved when the folder was published (renamed away) while we came in."""
    work.mkdir(exist_ok=True)
    try:
        return SharedFlock(work / LOCK, shared=tasked)
    except LockBusy as e:
        how = "a plain prepare" if tasked else "another prepare"
        raise PrepareError(
            f"{work} is being prepared by another process ({how}: {describe(e.holder)}); "
            "wait for it to finish, or stop it"
        ) from None


def unit_lock(work: Path, k: int, wait: bool) -> SharedFlock | None:
    """Unit k's lock, or None when another process holds it and not `wait`."""
    try:
        return SharedFlock(mf.unit_record_path(work, k).with_suffix(".lock"), wait=wait)
    except LockBusy:
        return None


def check_shards(work: Path, meta: dict) -> None:
    """Every shard meta.json names is in `work` with the size its token count gives: a folder that lost a
    shard (a concurrent writer, a hand) is never published as complete."""
    width = np.dtype(meta["dtype"]).itemsize
    for s in meta["shards"]:
        try:
            size = (work / s["file"]).stat().st_size
            (work / s["docs"]).stat()
        except FileNotFoundError as e:
            raise PrepareError(
                f"{work}: shard {Path(e.filename).name} named in meta.json is missing; "
                "nothing was published (a re-run redoes its unit)"
            ) from None
        if size != s["num_tokens"] * width:
            raise PrepareError(
                f"{work}: shard {s['file']} holds {size} bytes, not the "
                f"{s['num_tokens'] * width} meta.json records; nothing was published"
            )


def publish(work: Path, out: Path, lock: SharedFlock, meta: dict) -> bool:
    """Write meta.json and rename `work` to `out`, as the only holder of `work`'s lock (waiting for other
    tasks to leave). False when another process published it while we waited."""
    try:
        lock.exclusive()
    except Moved:
        return False
    if (out / "meta.json").is_file():
        return False
    check_shards(work, meta)
    for bad in _unrecorded(work, meta):  # leftovers of interrupted runs: not part of OUT
        bad.unlink()
    mf.write_json(work / "meta.json", meta)
    shutil.rmtree(work / "units")  # resume records: meta.json now says it all
    (work / "settings.json").unlink()
    for lock_file in work.glob(".*lock*"):  # the tokenizer's lock; ours moves with the folder, then goes
        if lock_file.name != LOCK:
            lock_file.unlink(missing_ok=True)
    os.rename(work, out)  # atomic; replaces only a missing or empty folder
    # removed after the rename: a process arriving meanwhile found no folder or our lock, never a new one
    (out / LOCK).unlink(missing_ok=True)
    lock.release()
    return True


def _unrecorded(work: Path, meta: dict) -> list[Path]:
    named = {n for s in meta["shards"] for n in (s["file"], s["docs"])}
    return [p for p in work.glob("shard_*") if p.name not in named]
