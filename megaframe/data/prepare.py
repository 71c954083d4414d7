"""Prepare a text corpus for training: train a tokenizer, tokenize, write flat token shards.

    python -m megaframe.data.prepare data.source=SRC data.path=OUT data.vocab_size=N

The arguments are Hydra overrides of the main config (conf/config.yaml); with none, the embedded demo
corpus is prepared into data/demo/prepared.

Input: data.source is a folder (every *.txt, *.txt.gz, *.jsonl(.gz), *.json(.gz), *.parquet under it,
recursively, sorted, hidden entries skipped), a glob, or one file. Files are read with the `datasets`
library in streaming mode (bounded memory; compressed files are decompressed on the fly), offline and
with its cache in a temp folder, so a fresh machine needs no network and no ~/.cache.

Documents: a jsonl/json/parquet record's data.text_key field is one document. A text file is read as
blank-line separated paragraphs and EACH PARAGRAPH is one document: the demo corpus is whole books, and
paragraph documents give the eos token real boundaries to learn while keeping every paragraph intact.
Documents are stripped of surrounding whitespace; empty ones are skipped.

Output (data.path): tokenizer.model; tokens_00000.bin, ... = one flat stream of little-endian uint16
token ids (uint32 when the vocabulary exceeds 65535), every document followed by eos, cut into shards
of at most SHARD_TOKENS tokens (a document may straddle two shards; readers concatenate them); and
meta.json describing it all. Everything is written into a hidden temp folder beside data.path and
renamed into place at the end, so an interrupted run never leaves a half-prepared data.path. A data.path
that already holds meta.json is left untouched.

Bad input prints one `megaframe: error: ...` line to stderr and exits 2.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from megaframe.config import Config, ConfigError, load_config
from megaframe.data.tokenizer import Tokenizer, TokenizerError, train_tokenizer

FORMAT = "megaframe-tokens-v1"
SHARD_TOKENS = 32 * 1024 * 1024
BATCH_DOCS = 1024
KINDS = {".txt": "text", ".txt.gz": "text", ".jsonl": "json", ".jsonl.gz": "json",
         ".json": "json", ".json.gz": "json", ".parquet": "parquet"}


class PrepareError(ValueError):
    """Bad input (source, text, vocabulary); main() turns it into exit code 2."""


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((k for suffix, k in KINDS.items() if name.endswith(suffix)), None)


def resolve_source(source: str) -> list[Path]:
    """The input files of data.source, sorted; raises PrepareError when there are none."""
    if not source:
        raise PrepareError("data.source is empty: set it to a folder or glob of .txt/.jsonl/.parquet files")
    root = Path(source)
    if any(c in source for c in "*?["):
        candidates = [Path(p) for p in glob.glob(source, recursive=True)]
    elif root.is_dir():
        candidates = [p for p in root.rglob("*") if not any(part.startswith(".") for part in p.relative_to(root).parts)]
    elif root.exists():
        candidates = [root]
    else:
        raise PrepareError(f"data.source={source} does not exist")
    files = sorted(p for p in candidates if p.is_file() and _kind(p))
    if not files:
        raise PrepareError(f"data.source={source}: no {', '.join(KINDS)} files found")
    return files


def _runs(files: list[Path]) -> list[tuple[str, list[Path]]]:
    """Consecutive files of one kind, so documents keep the sorted file order with few loader calls."""
    runs: list[tuple[str, list[Path]]] = []
    for f in files:
        if runs and runs[-1][0] == _kind(f):
            runs[-1][1].append(f)
        else:
            runs.append((_kind(f), [f]))
    return runs


def iter_documents(files: list[Path], text_key: str, cache_dir: str) -> Iterator[list[str]]:
    """Batches of non-empty, stripped documents, in file order. Read errors become PrepareError."""
    import datasets

    datasets.utils.logging.set_verbosity(50)  # CRITICAL: read errors are reported once, by us
    datasets.disable_progress_bars()
    for kind, group in _runs(files):
        extra = {"sample_by": "paragraph", "encoding_errors": "replace"} if kind == "text" else {}
        key = "text" if kind == "text" else text_key
        try:
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in group], split="train",
                                       streaming=True, cache_dir=cache_dir, **extra)
            for batch in ds.iter(batch_size=BATCH_DOCS):
                if key not in batch:
                    raise PrepareError(f"{group[0]}: records have no field {key!r} (set data.text_key)")
                docs = [t.strip() for t in batch[key] if isinstance(t, str)]
                yield [d for d in docs if d]
        except PrepareError:
            raise
        except Exception as e:  # datasets/pyarrow/json errors: name the files, keep one line
            where = group[0] if len(group) == 1 else f"{group[0]} (+{len(group) - 1} more)"
            raise PrepareError(f"cannot read {where}: {' '.join(str(e).split()) or type(e).__name__}") from e


@contextlib.contextmanager
def _offline_hf(cache_dir: str):
    """No network and no ~/.cache for `datasets`; the environment is restored afterwards (tests run in-process)."""
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": cache_dir,
           "HF_DATASETS_CACHE": cache_dir}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ShardWriter:
    """Appends token arrays to tokens_NNNNN.bin files of at most `max_tokens` tokens each."""

    def __init__(self, folder: Path, dtype: np.dtype, max_tokens: int):
        self.folder, self.dtype, self.max_tokens = folder, dtype, max_tokens
        self.shards: list[dict] = []
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                name = f"tokens_{len(self.shards):05d}.bin"
                self._file = open(self.folder / name, "wb")
                self.shards.append({"file": name, "num_tokens": 0})
            shard = self.shards[-1]
            room = self.max_tokens - shard["num_tokens"]
            part, tokens = tokens[:room], tokens[room:]
            self._file.write(part.tobytes())
            shard["num_tokens"] += int(part.size)
            if shard["num_tokens"] == self.max_tokens:
                self.close()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._file.close()
            self._file = None
        return self.shards


def _train(files: list[Path], cfg: Config, cache_dir: str, work: Path) -> Tokenizer:
    """Pass 1: train the tokenizer on every document (raises PrepareError when there is no text)."""
    docs = (d for batch in iter_documents(files, cfg.data.text_key, cache_dir) for d in batch)
    first = next(docs, None)
    if first is None:
        raise PrepareError(f"data.source={cfg.data.source}: the files hold no text")
    try:
        path = train_tokenizer(_chain(first, docs), cfg.data.vocab_size, work / "tokenizer", seed=cfg.train.seed)
    except TokenizerError as e:
        raise PrepareError(f"data.vocab_size={cfg.data.vocab_size}: {e}") from e
    return Tokenizer.load(path)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _encode(files: list[Path], cfg: Config, tok: Tokenizer, cache_dir: str, work: Path,
            shard_tokens: int) -> tuple[int, list[dict], np.dtype]:
    """Pass 2: tokenize batches of documents, eos after each, into shards. Returns (docs, shards, dtype)."""
    dtype = np.dtype("<u2") if tok.vocab_size <= 1 << 16 else np.dtype("<u4")
    writer, num_docs = ShardWriter(work, dtype, shard_tokens), 0
    try:
        for batch in iter_documents(files, cfg.data.text_key, cache_dir):
            flat: list[int] = []
            for ids in tok.encode(batch):
                flat.extend(ids)
                flat.append(tok.eos_id)
            writer.write(np.asarray(flat, dtype=dtype))
            num_docs += len(batch)
    finally:
        shards = writer.close()
    return num_docs, shards, dtype


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(files: list[Path], cfg: Config, work: Path, shard_tokens: int) -> dict:
    """Write tokenizer.model, the shards and meta.json into `work`; returns the meta."""
    with tempfile.TemporaryDirectory(prefix="megaframe-hf-") as cache_dir, _offline_hf(cache_dir):
        tok = _train(files, cfg, cache_dir, work)
        num_docs, shards, dtype = _encode(files, cfg, tok, cache_dir, work, shard_tokens)
    meta = {"format": FORMAT, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "dtype": "uint16" if dtype.itemsize == 2 else "uint32",
            "num_tokens": sum(s["num_tokens"] for s in shards), "num_documents": num_docs,
            "shards": shards, "source": cfg.data.source, "tokenizer": "tokenizer.model",
            "tokenizer_sha256": _sha256(work / "tokenizer.model")}
    (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _check_output(out: Path) -> bool:
    """True when `out` is already prepared; raises PrepareError when it is something else."""
    if (out / "meta.json").is_file():
        return True
    if out.exists() and not out.is_dir():
        raise PrepareError(f"data.path={out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise PrepareError(f"data.path={out} is a non-empty folder without meta.json; remove it or pick another")
    return False


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _missing_parents(folder: Path) -> list[Path]:
    return [p for p in [folder, *folder.parents] if not p.exists()]


def prepare(cfg: Config, shard_tokens: int = SHARD_TOKENS) -> dict | None:
    """Prepare cfg.data.source into cfg.data.path; returns the meta, or None when it was already there."""
    out = Path(cfg.data.path)
    if not cfg.data.path:
        raise PrepareError("data.path is empty: set it to the output folder")
    if _check_output(out):
        return None
    if cfg.data.vocab_size < 260:  # 256 byte pieces + unk + eos + a few characters
        raise PrepareError(f"data.vocab_size={cfg.data.vocab_size} is too small (byte fallback alone needs 258)")
    files = resolve_source(cfg.data.source)
    created = _missing_parents(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(work, 0o777 & ~_umask())  # mkdtemp makes it 0700; other users' jobs must read the data
    done = False
    try:
        meta = _build(files, cfg, work, shard_tokens)
        try:
            os.rename(work, out)  # atomic; replaces only a missing or empty folder
        except OSError:
            if (out / "meta.json").is_file():  # a concurrent run finished first: its data is as good
                return None
            raise
        done = True
        return meta
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for p in created if not done else []:  # leave no empty parent folders behind on failure
            with contextlib.suppress(OSError):
                p.rmdir()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    try:
        cfg = load_config(argv, world_size=1, check_data=False)
        meta = prepare(cfg)
    except (ConfigError, PrepareError) as e:
        print(f"megaframe: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if meta is None:
        print(f"megaframe: {cfg.data.path} is already prepared (meta.json present); nothing to do")
        return 0
    secs = time.perf_counter() - start
    print(f"megaframe: prepared {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
          f"(vocab {meta['vocab_size']}, {len(meta['shards'])} shard(s)) in {secs:.1f}s "
          f"({meta['num_tokens'] / max(secs, 1e-9):,.0f} tokens/s) -> {cfg.data.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
