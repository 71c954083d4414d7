"""Prepare a text corpus for training: get a tokenizer, tokenize on every core, write token shards.

    python -m megaframe.data.prepare data.source=SRC data.path=OUT [data.vocab_size=N] [data.tokenizer=PATH]
                                     [data.tokenizer_sample_bytes=B] [data.num_workers=W] [data.text_key=K]
                                     [data.split=file|paragraph] [data.extensions=[.py,.md,...]]

The arguments are Hydra overrides of the main config (conf/config.yaml); with none, the embedded demo
corpus is prepared into data/demo/prepared. Sources and documents: see megaframe.data.sources.

Tokenizer: data.tokenizer=PATH reuses a sentencepiece .model file or a transformers tokenizer folder
(copied into OUT, loaded offline); otherwise a sentencepiece BPE of data.vocab_size pieces is trained on
~data.tokenizer_sample_bytes of text spread over the corpus (0 = all of it).

Work: the sorted source files are grouped into units (~UNIT_BYTES each). The main process streams each
unit's documents, cuts them into chunks and hands each chunk to one of data.num_workers processes
(0 = every core), which tokenizes it and writes one shard (megaframe.data.shards). The token stream is
the same whatever the worker count or chunk size: the documents in file order, each followed by eos.

Output (OUT): the tokenizer, shard_*.bin + shard_*.docs.npy, and meta.json, the manifest
(megaframe.data.manifest). Everything is built in a hidden `.OUT.partial` folder beside OUT and renamed
into place at the end, so OUT is either absent or complete. An interrupted run keeps the partial folder
and the next run resumes it, skipping finished units. Re-running on a finished OUT does nothing when the
sources and settings are the same, and refuses (exit 2) when they differ: good data is never overwritten.

Bad input prints one `megaframe: error: ...` line to stderr and exits 2.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Iterator

from megaframe.atomic_lock import Moved, SharedFlock
from megaframe.config import Config, ConfigError, DocSplit, load_config
from megaframe.data import manifest as mf
from megaframe.data import partial
from megaframe.data.prepare_tokenizer import put_tokenizer
from megaframe.data.progress import Progress
from megaframe.data.shards import encode_chunk, token_dtype
from megaframe.data.sources import (
    PrepareError,
    SourceFile,
    file_sha256,
    iter_documents,
    offline_hf,
    resolve_source,
    screen_head,
    skip_line,
    skipped,
    text_size,
    units,
)
from megaframe.data.tasks import announce, missing_line, unit_tasks, waiting_lock
from megaframe.data.tokenizer import load_tokenizer, tokenizer_sha256
from megaframe.errors import fail, write_refused

__all__ = ["PrepareError", "prepare", "main"]

UNIT_BYTES = 256 << 20  # the resume granularity: an interrupted run redoes only the units without a record
MAX_CHUNK_CHARS, MIN_CHUNK_CHARS = 8 << 20, 256 << 10


def prepare(cfg: Config, *, unit_bytes: int = UNIT_BYTES, chunk_chars: int | None = None,
            show_progress: bool | None = None, merge: bool = False) -> dict | None:
    """Prepare cfg.data.source into cfg.data.path. Returns meta.json's content plus 'stats' (timings),
    or None when data.path already holds exactly this preparation; under data.num_tasks, {"part": ...}
    when this task's units are done but not every task's. merge: tokenize nothing, write meta.json if
    every unit is there (megaframe.data.tasks). Raises PrepareError on bad input."""
    d = cfg.data
    if not d.path:
        raise PrepareError("data.path is empty: set it to the output folder")
    if not 0 <= d.task < d.num_tasks:
        raise PrepareError(f"data.task={d.task} must be in [0, data.num_tasks={d.num_tasks})")
    if not d.tokenizer and d.vocab_size < 260:  # 256 byte pieces + unk + eos + a few characters
        raise PrepareError(f"data.vocab_size={d.vocab_size} is too small (byte fallback alone needs 258)")
    out = Path(d.path)
    work = out.parent / f".{out.name}.partial"
    # OUT (or its partial folder) inside the source folder is this tool's output, never its input
    files = resolve_source(d.source, list(d.extensions), exclude=(out, work))
    skips = skipped(d.source, files, exclude=(out, work))
    if skip_line(skips, len(files)):  # a skipped file is named, never left out without a word
        print(skip_line(skips, len(files)), flush=True)
    for f in files:
        screen_head(f)
    if d.tokenizer and not Path(d.tokenizer).exists():
        raise PrepareError(f"data.tokenizer={d.tokenizer} does not exist")
    settings = mf.settings_of(d, tokenizer_sha256(d.tokenizer) if d.tokenizer else None)
    if _already_prepared(out, settings, files):
        return None
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh = not work.exists()
    try:  # a plain run holds the partial folder alone, tasks and merges share it (megaframe.data.partial)
        lock = partial.enter(work, tasked=d.num_tasks > 1 or merge)
    except (FileNotFoundError, Moved):  # published (renamed away) by another prepare while we came in
        if _already_prepared(out, settings, files):
            return None
        raise PrepareError(f"{work} was removed while this prepare started; run it again") from None
    done = False
    try:
        if _already_prepared(out, settings, files):  # a concurrent run finished first: its data is as good
            return None
        meta = _build(cfg, files, work, settings, unit_bytes, chunk_chars, show_progress, skips, merge, lock)
        done = True
        return meta
    except PrepareError as e:
        if any(work.glob("shard_*.bin")):
            raise PrepareError(f"{e} (finished work kept in {work}; a re-run resumes it)") from e
        raise
    finally:
        _leave(work, lock, created if not done and fresh else None)


def _leave(work: Path, lock: SharedFlock, created: list[Path] | None) -> None:
    """Give the partial folder back; one this run created and left without shards is removed, unless
    another prepare is in it."""
    try:
        empty = created is not None and lock.fd >= 0 and not any(work.glob("shard_*.bin"))
        if empty and lock.exclusive(wait=False):
            shutil.rmtree(work, ignore_errors=True)
            for p in created:
                with contextlib.suppress(OSError):
                    p.rmdir()
    except Moved:
        pass
    finally:
        lock.release()


def _already_prepared(out: Path, settings: dict, files: list[SourceFile]) -> bool:
    """True when `out` holds this very preparation; PrepareError when it holds anything else."""
    if (out / "meta.json").is_file():
        try:
            meta = json.loads((out / "meta.json").read_text())
        except ValueError as e:
            raise PrepareError(f"data.path={out}: meta.json is corrupt; refusing to overwrite it") from e
        mf.check_existing(out, meta, settings, files)
        return True
    if out.exists() and not out.is_dir():
        raise PrepareError(f"data.path={out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise PrepareError(f"data.path={out} is a non-empty folder without meta.json; remove it or pick another")
    return False


def _build(cfg: Config, files: list[SourceFile], work: Path, settings: dict, unit_bytes: int,
           chunk_chars: int | None, show_progress: bool | None, skips: dict | None, merge: bool,
           lock: SharedFlock) -> dict:
    """Tokenizer, shards and meta.json inside the partial folder `work`; returns the meta + stats, or
    {"part": ...} for a task whose units are done while others' are not (megaframe.data.tasks)."""
    t0 = time.perf_counter()
    old = work / "settings.json"
    if old.is_file() and json.loads(old.read_text()) != settings:
        raise PrepareError(f"{work} holds an unfinished preparation made with other settings "
                           f"({mf.describe_settings_change(json.loads(old.read_text()), settings)}); "
                           "delete it or restore them")
    # recorded before any work: a resumed run must be this preparation, not one with other settings
    mf.write_json(old, settings)
    os.chmod(work, 0o777 & ~_umask())  # other users' jobs must read the data
    workers = cfg.data.num_workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="megaframe-hf-") as cache, offline_hf(cache), _pool(workers) as pool:
        # hashed first: a re-run compares them to decide whether OUT is this very preparation
        records = [f.record(h) for f, h in zip(files, _map(pool, file_sha256, [f.path for f in files]))]
        with waiting_lock(work / ".tokenizer.lock"):  # under tasks: one trains it, the others wait and load it
            tok_name = put_tokenizer(cfg, files, work, cache)
        tok = load_tokenizer(work / tok_name)
        t1, cpu1 = time.perf_counter(), time.process_time()
        shards, worker_cpu = _encode(cfg, files, records, str(work / tok_name), work, pool, unit_bytes,
                         chunk_chars or _chunk_size(files, workers), cache, show_progress, merge)
        t2, cpu2 = time.perf_counter(), time.process_time()
    if isinstance(shards, dict):  # units missing: a task's part, or a refused merge
        if merge:
            raise PrepareError(missing_line(shards["missing"], shards["tasks"], Path(cfg.data.path)))
        return {"part": shards, "stats": {"seconds": time.perf_counter() - t0, "encode_seconds": t2 - t1}}
    num_tokens = sum(s["num_tokens"] for s in shards)
    if num_tokens == 0:
        raise PrepareError(f"data.source={cfg.data.source}: the files hold no text")
    meta = {"format": mf.FORMAT, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "dtype": token_dtype(tok.vocab_size).name, "num_tokens": num_tokens,
            "num_documents": sum(s["num_docs"] for s in shards), "shards": shards,
            "tokenizer": tok_name, "tokenizer_kind": tok.kind, "tokenizer_sha256": tokenizer_sha256(work / tok_name),
            "source": cfg.data.source, "sources": records, "settings": settings, "skipped": skips or {}}
    # after every shard: the folder is renamed into place only with meta.json, and only by one process
    if not partial.publish(work, Path(cfg.data.path), lock, meta):
        return {"part": {"task": cfg.data.task, "merged_by_another": True}, "stats": {}}
    return {**meta, "stats": {"workers": workers, "seconds": time.perf_counter() - t0,
                              "tokenizer_seconds": t1 - t0, "encode_seconds": t2 - t1,
                              "encode_cpu_seconds": cpu2 - cpu1 + worker_cpu}}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _pool(workers: int):
    """`workers` tokenizer processes, or None for in-process work. forkserver: the workers start from a
    clean process (no inherited torch/pyarrow threads), with numpy and the shard writer preloaded."""
    if workers <= 1:
        yield None
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megaframe.data.shards"])
    with ctx.Pool(workers) as pool:
        yield pool


def _map(pool, fn, items: list) -> list:
    return pool.map(fn, items, chunksize=1) if pool is not None else [fn(x) for x in items]


def _chunk_size(files: list[SourceFile], workers: int) -> int:
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
        recs, i = records[i:i + len(group)], i + len(group)
        per_unit.append(recs)
        rec = mf.finished_unit(work, k, recs)
        if rec is not None:
            done[k] = rec
        elif k in mine:
            todo.append((k, group, recs))
    return done, todo, per_unit


def _plan_units(cfg: Config, files: list[SourceFile], records: list[dict], work: Path, unit_bytes: int,
                merge: bool) -> tuple[list, list[int], tuple]:
    """The units, each unit's task, and (done, todo, per_unit) for this task (nothing to do for a merge)."""
    (work / "units").mkdir(exist_ok=True)
    groups = units(files, unit_bytes)
    owner = unit_tasks([sum(f.size for f in g) for g in groups], cfg.data.num_tasks)
    mine = {k for k in range(len(groups)) if owner[k] == cfg.data.task and not merge}
    return groups, owner, _split_units(work, groups, records, mine)


def _encode(cfg: Config, files: list[SourceFile], records: list[dict], tok_path: str, work: Path, pool,
            unit_bytes: int, chunk_chars: int, cache: str, show_progress: bool | None,
            merge: bool = False) -> tuple[list[dict] | dict, float]:
    """Tokenize every unit (of this task's part, under data.num_tasks; none for a merge) not finished by an
    earlier run or another process, each under its lock (megaframe.data.partial); returns all shards in
    stream order, or {"missing", "tasks"} while other tasks' units are not done; and the worker CPU
    seconds."""
    groups, owner, (done, todo, per_unit) = _plan_units(cfg, files, records, work, unit_bytes, merge)
    if not merge:  # a merge tokenizes nothing: it only checks and joins the tasks' units
        announce(cfg.data, [f for _, g, _ in todo for f in g], pool._processes if pool is not None else 1)
    progress = Progress(sum(text_size(f) for _, g, _ in todo for f in g), show_progress)
    pending: deque = deque()  # in stream order: ("chunk", k, result, chars) and ("unit", k, recs)
    limit = 2 * (pool._processes if pool is not None else 1)  # bounded memory: few chunks in flight
    acc: dict[int, list[dict]] = {}
    held: dict[int, SharedFlock] = {}  # the locks of the units being written, released with their records

    def drain(keep: int) -> None:
        while len(pending) > keep:
            item = pending.popleft()
            if item[0] == "chunk":
                entry = item[2].get()
                progress.worker_cpu += entry.pop("_cpu_s")
                acc[item[1]].append(entry)
                progress.update(item[1], item[3], entry["num_tokens"])
            else:
                rec = {"files": item[2], "shards": acc.pop(item[1])}
                _finish_unit(work, item[1], rec)
                done[item[1]] = rec
                held.pop(item[1]).release()
                progress.unit_done(item[1])

    try:
        for k, group, recs in todo:
            if not _take_unit(work, k, recs, held, done, drain):
                continue  # finished by the process we waited for
            acc[k] = []
            progress.start_unit(k, sum(text_size(f) for f in group))
            batches = iter_documents(group, cfg.data.text_key, cache, DocSplit(cfg.data.split).value)
            for c, (docs, chars) in enumerate(_chunks(batches, chunk_chars)):
                task = (tok_path, str(work), f"shard_{k:05d}_{c:05d}", docs)
                res = pool.apply_async(encode_chunk, (task,)) if pool is not None else _Ready(encode_chunk(task))
                pending.append(("chunk", k, res, chars))
                # results are taken in submission order, so shards and the token stream keep file order
                # whatever the workers finish first
                drain(limit)
            # the unit's record is written only after all its chunks: a record on disk means whole shards
            pending.append(("unit", k, recs))
        drain(0)
    except OSError as e:
        raise PrepareError(f"cannot write to {work}: {e}") from e
    finally:
        for lock in held.values():
            lock.release()
        progress.close()
    cpu = progress.worker_cpu if pool is not None else 0.0
    missing = _still_missing(work, done, per_unit)
    if missing:
        return {"task": cfg.data.task, "missing": missing, "tasks": owner, "units": len(groups)}, cpu
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    merge = bool(argv) and argv[0] == "merge"  # python -m megaframe.data.prepare merge data.path=... (same args)
    try:
        cfg = load_config(argv[1:] if merge else argv, world_size=1, check_data=False)
        meta = prepare(cfg, merge=merge)
    except (ConfigError, PrepareError) as e:
        return fail(e)
    except OSError as e:  # a full disk or the file-size limit outside the tokenizing loop (which says it too)
        if not write_refused(e):
            raise
        return fail(f"cannot write to {cfg.data.path} or its partial folder: {e}", code=1)
    if meta is not None and "part" in meta:
        part = meta["part"]
        left = f"{len(part['missing'])} unit(s) of other tasks still to do" if "missing" in part else "merged by another task"
        print(f"megaframe: prepare: task {cfg.data.task} of {cfg.data.num_tasks} done; {left}")
        return 0
    if meta is None:
        print(f"megaframe: {cfg.data.path} is already prepared from these sources and settings; nothing to do")
        return 0
    st = meta["stats"]
    print(f"megaframe: prepared {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
          f"(vocab {meta['vocab_size']}, {len(meta['shards'])} shard(s)) in {st['seconds']:.1f}s; "
          f"tokenizing with {st['workers']} worker(s): " f"{meta['num_tokens'] / max(st['encode_seconds'], 1e-9):,.0f} "
          f"tokens/s -> {cfg.data.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
