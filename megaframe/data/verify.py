"""Integrity of prepared token shards: sha256 against meta.json, and token ids inside the vocabulary.

    python -m megaframe.data verify PATH [PATH ...]     exit 0 when every shard checks, 2 otherwise

reads every byte once (sha256 and the largest token id of each shard, streamed in 16 MiB blocks).
A training run cannot afford that over a whole corpus on every rank, so at start ONE rank (global rank 0)
hashes only the shards the run's first global batch touches (`first_batch_shards`), at most
MAX_STARTUP_SHARDS of them: the cost is at most 8 shard files (the demo's are ~130 KB, 1 MB in all,
<0.01 s; a prepared shard is about one work unit of data.prepare), independent of the corpus size. Every other
read is guarded by the token-id range check that the
reader applies to each sample as it is read (megaframe.data.shards.check_token_range).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from megaframe.data.meta_rules import CHECKSUM_KEY
from megaframe.data.shards import read_index, read_meta
from megaframe.errors import fail
from megaframe.paths import inside

BLOCK = 16 << 20
MAX_STARTUP_SHARDS = 8
"""At start, hash at most this many of the first batch's shards (a shuffled batch touches up to
global_batch_size shards: the cost stays a few shard files at any scale)."""


def check_shard(folder: Path, entry: dict, dtype: np.dtype, vocab: int) -> str | None:
    """Why a shard is bad (missing, other sha256, a token id >= vocab), or None."""
    # a plain name inside the folder, as training reads it:
    # verify must not hash ../../etc/x either (an oracle)
    f = inside(folder, entry.get("file") if isinstance(entry, dict) else entry)
    if not f.is_file():
        return f"shard {entry['file']} is missing"
    h, off, where = hashlib.sha256(), 0, None
    with open(f, "rb") as fh:
        while chunk := fh.read(BLOCK - BLOCK % dtype.itemsize):  # whole ids per read: none split
            h.update(chunk)
            # a file cut mid-id leaves a partial last id: not decoded, the sha256 check catches it
            ids = np.frombuffer(chunk[: len(chunk) - len(chunk) % dtype.itemsize], dtype=dtype)
            if where is None and ids.size and int(ids.max()) >= vocab:
                at = int(np.argmax(ids >= vocab))
                where = (off + at, int(ids[at]))
            off += ids.size
    # no sha256 recorded (a format-v1 shard: meta.json's rules refuse one missing in later formats): the
    # caller reports the shard as unhashed, never as matching
    if entry.get("sha256") and h.hexdigest() != entry["sha256"]:
        return (
            f"shard {entry['file']} is corrupt (sha256 {h.hexdigest()[:16]}..., meta.json says "
            f"{entry['sha256'][:16]}...)"
        )
    if where is not None:
        return (
            f"shard {entry['file']} is corrupt: token id {where[1]} at token offset {where[0]} is outside "
            f"the vocabulary ({vocab})"
        )
    return None


def verify(path: str | Path, files: set[str] | None = None, unchecked: dict | None = None) -> int:
    """Check the shards of a prepared folder (only those named in `files`, if given) and their document
    indexes; returns the bytes read. ValueError names the first bad file. `unchecked` collects what
    meta.json records no checksum for, by kind: "shards" and "indexes" without a sha256 (checked for
    token range, resp. order and range), "meta" when meta.json itself has none (its fields were held to
    their rules: megaframe.data.meta_rules)."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except ValueError as e:  # the folder named once: verify is given several
        raise ValueError(str(e) if str(path) in str(e) else f"{path}: {e}") from e
    dtype, vocab, nbytes = np.dtype(meta["dtype"]), int(meta["vocab_size"]), 0
    notes: dict = unchecked if unchecked is not None else {}
    if not meta.get(CHECKSUM_KEY):
        notes.setdefault("meta", []).append("meta.json")
    for entry in meta["shards"]:
        if files is not None and entry["file"] not in files:
            continue
        why = check_shard(path, entry, dtype, vocab)
        if why:
            raise ValueError(f"{path}: {why}")
        nbytes += inside(path, entry["file"]).stat().st_size
        if not entry.get("sha256"):
            notes.setdefault("shards", []).append(entry["file"])
        if entry.get("docs"):  # the index decides the train/valid split: a bad one moves it silently
            try:
                read_index(path, entry)
            except OSError as e:
                why = f"document index {entry['docs']} is unreadable ({e.strerror})"
                raise ValueError(f"{path}: {why}") from e
            nbytes += inside(path, entry["docs"]).stat().st_size
            if not entry.get("docs_sha256"):
                notes.setdefault("indexes", []).append(entry["docs"])
    return nbytes


def check_tokenizer(path: str | Path) -> None:
    """The folder's tokenizer is the one its shards were made with (its sha256) and has the vocabulary
    meta.json records (a tokenizer folder too, which start-up leaves to this). ValueError."""
    from megaframe.data.shards import check_prepared, vocab_problem

    try:
        meta = check_prepared(path)
        vocab_problem(meta, inside(path, meta.get("tokenizer", "tokenizer.model")))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def summary(notes: dict, nbytes: int, seconds: float) -> str:
    """verify's line: what matched its checksum, and, honestly, what had none to match."""
    shards, indexes, meta = (notes.get(k, []) for k in ("shards", "indexes", "meta"))
    what = (
        "every shard matches its sha256 and vocabulary"
        if not shards
        else f"{len(shards)} shard(s) have no sha256 in meta.json (format megaframe-tokens-v1): only their "
        "token ids were checked against the vocabulary, the other shards match their sha256"
    )
    if indexes:
        what += (
            f"; {len(indexes)} document index(es) have no sha256 in meta.json (prepared before it was "
            "recorded): only their order and range were checked"
        )
    what += (
        "; meta.json has no checksum (prepared before it was recorded): its fields were checked by their "
        "rules"
        if meta
        else "; meta.json matches its checksum"
    )
    return f"{what} ({nbytes / 1e6:.1f} MB read in {seconds:.2f}s)"


def first_batch_shards(data, step: int, global_batch: int, base: int, seed: int) -> dict[Path, set[str]]:
    """{dataset folder: shard files} that the global batch of `step` (0-based, from sample position
    `base`) reads: found by reading that batch once on the host with the readers recording their shards."""
    from megaframe.data.dataset import BatchShape, microbatches
    from megaframe.parallel.mesh import single_process_mesh

    parts = data.parts  # the file readers under the data (Samples.parts: [] for generated data)
    for p in parts:
        p.touched = set()
    try:
        # the whole global batch as dp=1 in one micro-batch: the samples of that step under any layout
        microbatches(data, step, BatchShape(global_batch, global_batch, seed, base), single_process_mesh())
        touched = [(p.path, p.meta["shards"][k]["file"]) for p in parts for k in sorted(p.touched)]
        out: dict[Path, set[str]] = {}
        for folder, name in touched[:MAX_STARTUP_SHARDS]:
            out.setdefault(folder, set()).add(name)
        return out
    finally:
        for p in parts:
            # stop recording: training reads must not keep growing the sets
            p.touched = None


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "verify":
        print("usage: python -m megaframe.data verify PATH [PATH ...]", file=sys.stderr)
        return 2
    for path in argv[1:]:
        t0, notes = time.perf_counter(), {}
        try:
            nbytes = verify(path, unchecked=notes)
            check_tokenizer(path)
        except ValueError as e:
            return fail(e)
        print(f"{path}: {summary(notes, nbytes, time.perf_counter() - t0)}", flush=True)
    return 0
