"""Tokenizing the units of a preparation (megaframe.data.prepare): the worker pool, the chunks of each
unit's documents handed to it, each unit under its lock with its record written once its shards are whole,
and the units other tasks or earlier runs finished (prepare/tasks.py, prepare/partial.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import deque
from pathlib import Path
from typing import Iterator

from megaframe.atomic_lock import SharedFlock
from megaframe.config.choices import DocSplit
from megaframe.config.schema import DataConfig
from megaframe.data.prepare import manifest as mf
from megaframe.data.prepare import partial
from megaframe.data.prepare.progress import Progress
from megaframe.data.prepare.sources import PrepareError, SourceFile, iter_documents, text_size, units
from megaframe.data.prepare.tasks import announce, unit_tasks, waiting_lock
from megaframe.data.shards import encode_chunk
from megaframe.errors import write_refused

MAX_CHUNK_CHARS, MIN_CHUNK_CHARS = 8 << 20, 256 << 10


@contextlib.contextmanager
def worker_pool(workers: int):
    """`workers` tokenizer processes, or None for in-process work. forkserver: the workers start from a
    clean process (no inherited torch/pyarrow threads), with numpy and the shard writer preloaded."""
    if workers <= 1:
        yield None
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megaframe.data.shards"])
    with ctx.Pool(workers) as pool:
        yield pool


def pool_map(pool, fn, items: list) -> list:
    return pool.map(fn, items, chunksize=1) if pool is not None else [fn(x) for x in items]


def chunk_size(files: list[SourceFile], workers: int) -> int:
    """About four chunks per worker on a small corpus (all cores busy), capped for bounded memory."""
    return max(MIN_CHUNK_CHARS, min(MAX_CHUNK_CHARS, sum(f.size for f in files) // (4 * workers)))


def _chunks(batches: Iterator[list[str]], chunk_chars: int) -> Iterator[tuple[list[str], int]]:
    buf, n = [], 0
    for batch in batches:
        for doc in batch:
            buf.append(doc)
            n += len(doc)
            if n >= chunk_chars:
                yield buf, n
                buf, n = [], 0
    if buf:
        yield buf, n


class _Ready:
    """An already computed result with AsyncResult's get(), for in-process work."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def _finish_unit(work: Path, k: int, record: dict) -> None:
    mf.write_json(mf.unit_record_path(work, k), record)


def _split_units(work: Path, groups: list[list[SourceFile]], records: list[dict], mine: set[int]):
    """({unit: record} finished by an earlier run or another task, [(unit, files, records)] of `mine` to do,
    [records of each unit's files])."""
    done, todo, per_unit, i = {}, [], [], 0
    for k, group in enumerate(groups):
        recs, i = records[i : i + len(group)], i + len(group)
        per_unit.append(recs)
        rec = mf.finished_unit(work, k, recs)
        if rec is not None:
            done[k] = rec
        elif k in mine:
            todo.append((k, group, recs))
    return done, todo, per_unit


def _plan_units(
    d: DataConfig, files: list[SourceFile], records: list[dict], work: Path, unit_bytes: int, merge: bool
) -> tuple[list, list[int], tuple]:
    """The units, each unit's task, and (done, todo, per_unit) for this task (nothing to do for a merge)."""
    (work / "units").mkdir(exist_ok=True)
    groups = units(files, unit_bytes)
    owner = unit_tasks([sum(f.size for f in g) for g in groups], d.num_tasks)
    mine = {k for k in range(len(groups)) if owner[k] == d.task and not merge}
    return groups, owner, _split_units(work, groups, records, mine)


class _InOrder:
    """The chunks in flight and the units they end, in stream order: ("chunk", k, result, chars) and
    ("unit", k, recs). Results are taken in submission order, so shards and the token stream keep file
    order whatever the workers finish first; a unit's record is written once all its chunks are taken."""

    def __init__(self, work: Path, done: dict, held: dict, progress: Progress):
        self.work, self.done, self.held, self.progress = work, done, held, progress
        self.pending: deque = deque()
        self.acc: dict[int, list[dict]] = {}

    def drain(self, keep: int) -> None:
        pending, acc, progress = self.pending, self.acc, self.progress
        while len(pending) > keep:
            item = pending.popleft()
            if item[0] == "chunk":
                entry = item[2].get()
                progress.worker_cpu += entry.pop("_cpu_s")
                acc[item[1]].append(entry)
                progress.update(item[1], item[3], entry["num_tokens"])
            else:
                rec = {"files": item[2], "shards": acc.pop(item[1])}
                _finish_unit(self.work, item[1], rec)
                self.done[item[1]] = rec
                self.held.pop(item[1]).release()
                progress.unit_done(item[1])


def encode_units(
    d: DataConfig,
    files: list[SourceFile],
    records: list[dict],
    tok_path: str,
    work: Path,
    pool,
    unit_bytes: int,
    chunk_chars: int,
    cache: str,
    show_progress: bool | None,
    merge: bool = False,
) -> tuple[list[dict] | dict, float]:
    """Tokenize every unit (of this task's part, under data.num_tasks; none for a merge) not finished by an
    earlier run or another process, each under its lock (prepare/partial.py); returns all shards in
    stream order, or {"missing", "tasks"} while other tasks' units are not done; and the worker CPU
    seconds."""
    groups, owner, (done, todo, per_unit) = _plan_units(d, files, records, work, unit_bytes, merge)
    if not merge:  # a merge tokenizes nothing: it only checks and joins the tasks' units
        announce(d, [f for _, g, _ in todo for f in g], pool._processes if pool is not None else 1)
    progress = Progress(sum(text_size(f) for _, g, _ in todo for f in g), show_progress)
    limit = 2 * (pool._processes if pool is not None else 1)  # bounded memory: few chunks in flight
    held: dict[int, SharedFlock] = {}  # the locks of the units being written, released with their records
    stream = _InOrder(work, done, held, progress)
    try:
        for k, group, recs in todo:
            if not _take_unit(work, k, recs, held, done, stream.drain):
                continue  # finished by the process we waited for
            stream.acc[k] = []
            progress.start_unit(k, sum(text_size(f) for f in group))
            batches = iter_documents(group, d.text_key, cache, DocSplit(d.split).value)
            for c, (docs, chars) in enumerate(_chunks(batches, chunk_chars)):
                task = (tok_path, str(work), f"shard_{k:05d}_{c:05d}", docs)
                res = (
                    pool.apply_async(encode_chunk, (task,))
                    if pool is not None
                    else _Ready(encode_chunk(task))
                )
                stream.pending.append(("chunk", k, res, chars))
                stream.drain(limit)
            # the unit's record is written only after all its chunks: a record on disk means whole shards
            stream.pending.append(("unit", k, recs))
        stream.drain(0)
    except OSError as e:
        if write_refused(e):  # a full disk is no bad input: prepare's main says so in one line, exit 1
            raise
        raise PrepareError(f"cannot write to {work}: {e}") from e
    finally:
        for lock in held.values():
            lock.release()
        progress.close()
    cpu = progress.worker_cpu if pool is not None else 0.0
    missing = _still_missing(work, done, per_unit)
    if missing:
        return {"task": d.task, "missing": missing, "tasks": owner, "units": len(groups)}, cpu
    return [s for k in sorted(done) for s in done[k]["shards"]], cpu


def _take_unit(work: Path, k: int, recs: list[dict], held: dict, done: dict, drain) -> bool:
    """Take unit k's lock (waiting, with none of ours held, while another process writes it); True when the
    unit is ours to write, False when the process we waited for recorded it."""
    lock = partial.unit_lock(work, k, wait=False)
    if lock is None:  # another task of another split is writing it: wait our turn
        drain(0)
        lock = partial.unit_lock(work, k, wait=True)
    rec = mf.finished_unit(work, k, recs)
    if rec is not None:
        lock.release()
        done[k] = rec
        return False
    held[k] = lock
    # under the unit's lock nobody else writes it: what is there comes from a run that stopped mid-unit. The
    # unit is rewritten whole (its chunk count may differ from the interrupted run's: another chunk size)
    for stale in work.glob(f"shard_{k:05d}_*"):
        stale.unlink()
    return True


def _still_missing(work: Path, done: dict, per_unit: list[list[dict]]) -> list[int]:
    """Units without a record, looked up again under the merge lock: of tasks finishing together, each
    wrote its records before taking it, so the last one to take it sees every record and publishes."""
    with waiting_lock(work / ".merge.lock"):
        for k, recs in enumerate(per_unit):
            if k not in done and (rec := mf.finished_unit(work, k, recs)) is not None:
                done[k] = rec
    return [k for k in range(len(per_unit)) if k not in done]
