"""prepare as N tasks (`data.task=i data.num_tasks=N`, e.g. a Slurm job array: scripts/slurm/prepare.sbatch).

The source files' units (data.sources.units: consecutive files, ~UNIT_BYTES each) are cut into N contiguous
ranges balanced by bytes; task i tokenizes range i into the shared partial folder `.OUT.partial` (one
filesystem all tasks see), each unit's record written once its shards are whole, exactly as one task
writes them. The tokenizer is trained (or copied) once: the first task to take its lock does it while the
others wait on the lock, then load it. The task that finds every unit done (looked up again under a merge
lock, so the last of several finishing together sees every record) writes meta.json and renames the folder
into place once the other tasks have left it (megaframe.data.prepare.partial: the folder and unit locks);
`prepare merge` does the same by hand, and refuses, naming the missing units and their tasks, while any is
missing. The shards, their order and the token stream are those of one task with the same
data.num_workers (chunk sizes come from the whole file list), so the output equals the one-task output
shard for shard.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


def unit_tasks(sizes: list[int], num_tasks: int) -> list[int]:
    """The task of each unit: contiguous ranges, each unit going where its middle byte falls."""
    total, acc, out = max(sum(sizes), 1), 0, []
    for s in sizes:
        out.append(min(num_tasks - 1, int((acc + s / 2) * num_tasks / total)))
        acc += s
    return out


@contextmanager
def waiting_lock(path: Path):
    """A blocking exclusive flock (the kernel drops it if the holder dies): tasks take turns."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def missing_line(missing: list[int], tasks: list[int], out: Path) -> str:
    """One line naming the units not done and the tasks that own them."""
    owners = sorted({tasks[k] for k in missing})
    return (
        f"data.path={out}: {len(missing)} of {len(tasks)} unit(s) not prepared yet (units "
        f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}; tasks "
        f"{', '.join(map(str, owners))}): run those tasks (data.task=I) before the merge"
    )


def announce(d, todo: list, workers: int) -> None:
    """prepare's line on what this run tokenizes (d: the DataConfig): the files of its own units still to do
    (under data.num_tasks, this task's share; after an interruption, what is left), empty files not counted
    (they are skipped): a task with none of its own says so rather than the whole corpus's count."""
    live = [f for f in todo if f.size]
    task = f"task {d.task} of {d.num_tasks}: " if d.num_tasks > 1 else ""
    if not live:
        print(
            f"megaframe: prepare: {task}nothing to tokenize (its units are done or belong to other tasks)",
            flush=True,
        )
        return
    print(
        f"megaframe: prepare: {task}tokenizing {len(live):,} "
        f"files ({sum(f.size for f in live) / 1e6:,.1f} MB) "
        f"with {workers} worker(s)",
        flush=True,
    )
