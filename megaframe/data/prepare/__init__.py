"""Prepare a text corpus for training: get a tokenizer, tokenize on every core, write token shards.

    python -m megaframe.data.prepare data.source=SRC data.path=OUT [data.vocab_size=N] [data.tokenizer=PATH]
                                     [data.tokenizer_sample_bytes=B] [data.num_workers=W] [data.text_key=K]
                                     [data.split=file|paragraph] [data.extensions=[.py,.md,...]]

The arguments are Hydra overrides of the main config (conf/config.yaml); with none, the embedded demo
corpus is prepared into data/demo/prepared. Sources and documents: see megaframe.data.prepare.sources.

Tokenizer: data.tokenizer=PATH reuses a sentencepiece .model file or a transformers tokenizer folder
(copied into OUT, loaded offline); otherwise a sentencepiece BPE of data.vocab_size pieces is trained on
~data.tokenizer_sample_bytes of text spread over the corpus (0 = all of it).

Work: the sorted source files are grouped into units (~UNIT_BYTES each). The main process streams each
unit's documents, cuts them into chunks and hands each chunk to one of data.num_workers processes
(0 = every core), which tokenizes it and writes one shard (megaframe.data.shards). The token stream is
the same whatever the worker count or chunk size: the documents in file order, each followed by eos.

Output (OUT): the tokenizer, shard_*.bin + shard_*.docs.npy, and meta.json, the manifest
(prepare/manifest.py). Everything is built in a hidden `.OUT.partial` folder beside OUT and renamed
into place at the end, so OUT is either absent or complete. An interrupted run keeps the partial folder
and the next run resumes it, skipping finished units. Re-running on a finished OUT does nothing when the
sources and settings are the same, and refuses (exit 2) when they differ: good data is never overwritten.

Bad input prints one `megaframe: error: ...` line to stderr and exits 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from megaframe.atomic_lock import Moved, SharedFlock
from megaframe.config import Config, ConfigError, load_config
from megaframe.data.meta_rules import sealed
from megaframe.data.prepare import manifest as mf
from megaframe.data.prepare import partial
from megaframe.data.prepare.prepare_tokenizer import put_tokenizer
from megaframe.data.prepare.sources import (
    PrepareError,
    SourceFile,
    file_sha256,
    offline_hf,
    resolve_source,
    screen_head,
    skip_line,
    skipped,
)
from megaframe.data.prepare.tasks import missing_line, waiting_lock
from megaframe.data.prepare.unit_encoding import chunk_size, encode_units, pool_map, worker_pool
from megaframe.data.shards import token_dtype
from megaframe.data.tokenizer import load_tokenizer, tokenizer_sha256
from megaframe.errors import fail, write_refused

__all__ = ["PrepareError", "prepare", "main"]

UNIT_BYTES = 256 << 20  # the resume granularity: an interrupted run redoes only the units without a record


def prepare(
    cfg: Config,
    *,
    unit_bytes: int = UNIT_BYTES,
    chunk_chars: int | None = None,
    show_progress: bool | None = None,
    merge: bool = False,
) -> dict | None:
    """Prepare cfg.data.source into cfg.data.path. Returns meta.json's content plus 'stats' (timings),
    or None when data.path already holds exactly this preparation; under data.num_tasks, {"part": ...}
    when this task's units are done but not every task's. merge: tokenize nothing, write meta.json if
    every unit is there (megaframe.data.prepare.tasks). Raises PrepareError on bad input."""
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
    # a plain run holds the partial folder alone, tasks and merges share it (prepare/partial.py)
    try:
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
        raise PrepareError(
            f"data.path={out} is a non-empty folder without meta.json; remove it or pick another"
        )
    return False


def _build(
    cfg: Config,
    files: list[SourceFile],
    work: Path,
    settings: dict,
    unit_bytes: int,
    chunk_chars: int | None,
    show_progress: bool | None,
    skips: dict | None,
    merge: bool,
    lock: SharedFlock,
) -> dict:
    """Tokenizer, shards and meta.json inside the partial folder `work`; returns the meta + stats, or
    {"part": ...} for a task whose units are done while others' are not (megaframe.data.prepare.tasks)."""
    t0 = time.perf_counter()
    _claim_settings(work, settings)
    os.chmod(work, 0o777 & ~_umask())  # other users' jobs must read the data
    workers = cfg.data.num_workers or os.cpu_count() or 1
    with (
        tempfile.TemporaryDirectory(prefix="megaframe-hf-") as cache,
        offline_hf(cache),
        worker_pool(workers) as pool,
    ):
        # hashed first: a re-run compares them to decide whether OUT is this very preparation
        records = [f.record(h) for f, h in zip(files, pool_map(pool, file_sha256, [f.path for f in files]))]
        tok_name, tok = _tokenizer(cfg, files, work, cache)
        t1, cpu1 = time.perf_counter(), time.process_time()
        shards, worker_cpu = encode_units(
            cfg.data,
            files,
            records,
            str(work / tok_name),
            work,
            pool,
            unit_bytes,
            chunk_chars or chunk_size(files, workers),
            cache,
            show_progress,
            merge,
        )
        t2, cpu2 = time.perf_counter(), time.process_time()
    if isinstance(shards, dict):  # units missing: a task's part, or a refused merge
        if merge:
            raise PrepareError(missing_line(shards["missing"], shards["tasks"], Path(cfg.data.path)))
        return {"part": shards, "stats": {"seconds": time.perf_counter() - t0, "encode_seconds": t2 - t1}}
    meta = _meta(cfg, work, tok, tok_name, shards, records, settings, skips)
    # after every shard: the folder is renamed into place only with meta.json, and only by one process
    if not partial.publish(work, Path(cfg.data.path), lock, meta):
        return {"part": {"task": cfg.data.task, "merged_by_another": True}, "stats": {}}
    return {
        **meta,
        "stats": {
            "workers": workers,
            "seconds": time.perf_counter() - t0,
            "tokenizer_seconds": t1 - t0,
            "encode_seconds": t2 - t1,
            "encode_cpu_seconds": cpu2 - cpu1 + worker_cpu,
        },
    }


def _tokenizer(cfg: Config, files: list[SourceFile], work: Path, cache: str):
    """The tokenizer's file name in `work` and the tokenizer, put there by this task or another one."""
    # under tasks: one trains it, the others wait and load it
    with waiting_lock(work / ".tokenizer.lock"):
        tok_name = put_tokenizer(cfg.data, files, work, cache)
    return tok_name, load_tokenizer(work / tok_name)


def _claim_settings(work: Path, settings: dict) -> None:
    """Record `settings` in the partial folder, or refuse one an unfinished run with other settings left."""
    old = work / "settings.json"
    if old.is_file() and json.loads(old.read_text()) != settings:
        raise PrepareError(
            f"{work} holds an unfinished preparation made with other settings "
            f"({mf.describe_settings_change(json.loads(old.read_text()), settings)}); "
            "delete it or restore them"
        )
    # recorded before any work: a resumed run must be this preparation, not one with other settings
    mf.write_json(old, settings)


def _meta(
    cfg: Config,
    work: Path,
    tok,
    tok_name: str,
    shards: list[dict],
    records: list[dict],
    settings: dict,
    skips: dict | None,
) -> dict:
    """meta.json's content (megaframe.data.prepare.manifest) for the shards written in `work` with `tok`;
    PrepareError when they hold no token."""
    num_tokens = sum(s["num_tokens"] for s in shards)
    if num_tokens == 0:
        raise PrepareError(f"data.source={cfg.data.source}: the files hold no text")
    meta = {
        "format": mf.FORMAT,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": token_dtype(tok.vocab_size).name,
        "num_tokens": num_tokens,
        "num_documents": sum(s["num_docs"] for s in shards),
        "shards": shards,
        "tokenizer": tok_name,
        "tokenizer_kind": tok.kind,
        "tokenizer_sha256": tokenizer_sha256(work / tok_name),
        "source": cfg.data.source,
        "sources": records,
        "settings": settings,
        "skipped": skips or {},
    }
    # last: the checksum covers every field above (readers compare it: megaframe.data.meta_rules)
    return sealed(meta)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # python -m megaframe.data.prepare merge data.path=... (same args)
    merge = bool(argv) and argv[0] == "merge"
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
        left = (
            f"{len(part['missing'])} unit(s) of other tasks still to do"
            if "missing" in part
            else "merged by another task"
        )
        print(f"megaframe: prepare: task {cfg.data.task} of {cfg.data.num_tasks} done; {left}")
        return 0
    if meta is None:
        print(
            f"megaframe: {cfg.data.path} is already prepared from these sources and settings; nothing to do"
        )
        return 0
    st = meta["stats"]
    print(
        f"megaframe: prepared {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
        f"(vocab {meta['vocab_size']}, {len(meta['shards'])} shard(s)) in {st['seconds']:.1f}s; "
        f"tokenizing with {st['workers']} worker(s): "
        f"{meta['num_tokens'] / max(st['encode_seconds'], 1e-9):,.0f} "
        f"tokens/s -> {cfg.data.path}"
    )
    return 0
