"""Token shards on disk: the worker that writes one, and the check that a prepared folder is whole.

A shard is a chunk of consecutive documents of one work unit, written by one worker process:
  shard_UUUUU_CCCCC.bin        flat little-endian uint16 (uint32 for vocabularies over 65536) token ids,
                               every document followed by eos;
  shard_UUUUU_CCCCC.docs.npy   int64 offsets (in tokens, within the shard) where each document starts:
                               the document-boundary index (validation split on a document boundary,
                               document-aware tools later).
Both are written under a temp name and renamed, so a crash never leaves a half shard under a real name.
Shards hold whole documents; the reader concatenates them in meta.json order into one token stream.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from itertools import chain
from pathlib import Path

import numpy as np

from megaframe.atomic import write_atomic
from megaframe.config.schema import DataConfig
from megaframe.data.meta_rules import meta_problem, token_dtype
from megaframe.paths import inside

_TOKENIZERS: dict = {}  # per worker process: tokenizer path -> loaded tokenizer


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from megaframe.data.tokenizer import load_tokenizer

        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


def encode_chunk(task: tuple) -> dict:
    """Tokenize one chunk of documents and write it as a shard; runs in a worker process.

    task = (tokenizer_path, out_dir, shard_name, docs). Returns the shard's meta.json entry, plus the
    worker's CPU seconds under "_cpu_s" (for prepare's figures; not written to meta.json).
    """
    cpu0 = time.process_time()
    tok_path, out_dir, name, docs = task
    tok = _tokenizer(tok_path)
    # one thread: the processes give the parallelism
    ids = tok.encode(docs, num_threads=1)
    eos = tok.eos_id
    lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
    total = int(lengths.sum())
    dtype = token_dtype(tok.vocab_size)
    flat = np.fromiter(chain.from_iterable(chain(x, (eos,)) for x in ids), dtype=dtype, count=total)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = Path(out_dir)
    data = flat.tobytes()
    # a crash may leave a shard without its index, but never a
    # half file; prepare writes meta.json, which names them, last
    write_atomic(out / f"{name}.bin", data)
    starts_npy = io.BytesIO()
    np.save(starts_npy, starts)
    write_atomic(out / f"{name}.docs.npy", starts_npy.getvalue())
    return {
        "file": f"{name}.bin",
        "num_tokens": total,
        "num_docs": len(docs),
        "docs": f"{name}.docs.npy",
        # hashed from the bytes in memory: verify checks the files against it later, prepare reads
        # nothing twice; the document index too: it decides the train/valid split
        "sha256": hashlib.sha256(data).hexdigest(),
        "docs_sha256": hashlib.sha256(starts_npy.getvalue()).hexdigest(),
        "_cpu_s": time.process_time() - cpu0,
    }


class NotPrepared(ValueError):
    """The folder holds no prepared data (no meta.json); check_datasets names the command that prepares it."""


def prepare_command(data_cfg, path) -> str:
    """The exact command that prepares `path`: a folder already holding files (a raw corpus given as
    data.path) as the source of a new folder beside it; plain `prepare` for the demo (its source and path are
    the data=demo defaults); else the source and path of the run's config."""
    from megaframe.config.schema import ROOT

    folder = Path(path)
    # source files, most likely: prepare refuses to write into them
    if folder.is_dir() and any(folder.iterdir()):
        out = f"{str(path).rstrip('/')}-prepared"
        return f"python -m megaframe.data.prepare data.source={path} data.path={out} (then data.path={out})"
    if data_cfg.name == "demo" and data_cfg.source == str(ROOT / "data/demo/corpus"):
        if Path(path).resolve() == (ROOT / "data/demo/prepared").resolve():
            return "python -m megaframe.data.prepare (or: make data)"
        return f"python -m megaframe.data.prepare data.path={path}"
    source = data_cfg.source or "YOUR_TEXT_FOLDER"
    return f"python -m megaframe.data.prepare data.source={source} data.path={path}"


def read_meta(path: Path) -> dict:
    """meta.json of a prepared folder; ValueError names what is wrong."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        int(meta["vocab_size"])
        np.dtype(meta["dtype"])
        list(meta["shards"])
    except FileNotFoundError as e:
        raise NotPrepared(
            "no prepared data (meta.json missing); run python -m megaframe.data.prepare "
            f"data.source=... data.path={path}"
        ) from e
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"meta.json is corrupt ({' '.join(str(e).split()) or type(e).__name__})") from e
    # a file given for the folder, or an unreadable meta.json: bad input, not a traceback
    except OSError as e:
        raise ValueError(
            f"{path}: not a readable prepared data folder ({e.strerror or type(e).__name__})"
        ) from e
    for i, s in enumerate(meta["shards"]):  # every reader indexes these fields: a wrong type is one line
        if not (
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and isinstance(s.get("num_tokens", 0), int)
            and all(isinstance(s.get(k), (str, type(None))) for k in ("docs", "sha256", "docs_sha256"))
        ):
            raise ValueError(
                f"meta.json is corrupt (shards[{i}] is {str(s)[:60]!r}, not an object with a "
                "file name and num_tokens)"
            )
    # how the shards are read (dtype, vocabulary, counts) is meta.json's word: its checksum and rules
    why = meta_problem(meta)
    if why:
        raise ValueError(f"meta.json is corrupt: {why}")
    return meta


def index_problem(starts: np.ndarray, num_tokens: int) -> str | None:
    """Why a shard's document index (token offsets where its documents start) is wrong, or None: it must be
    whole offsets, strictly increasing, inside the shard's num_tokens (a wrong entry moves the train/valid
    split)."""
    if starts.ndim != 1 or starts.dtype.kind not in "iu":
        return f"not a list of token offsets (shape {starts.shape}, dtype {starts.dtype})"
    if starts.size and (int(starts[0]) < 0 or int(starts[-1]) >= num_tokens):
        bad = int(starts[0]) if int(starts[0]) < 0 else int(starts[-1])
        return f"offset {bad} lies outside the shard's {num_tokens} tokens"
    if starts.size > 1 and not bool(np.all(np.diff(starts.astype(np.int64)) > 0)):
        at = int(np.argmax(np.diff(starts.astype(np.int64)) <= 0)) + 1
        return f"entry {at} ({int(starts[at])}) does not come after entry {at - 1} ({int(starts[at - 1])})"
    return None


def read_index(folder: Path, entry: dict) -> np.ndarray:
    """A shard's document index, checked against meta.json's docs_sha256 (folders prepared before it was
    recorded: order and range only); ValueError naming the file."""
    f = inside(folder, entry["docs"])
    raw = f.read_bytes()
    want = entry.get("docs_sha256")
    if want and hashlib.sha256(raw).hexdigest() != want:
        got = hashlib.sha256(raw).hexdigest()
        raise ValueError(
            f"document index {f} is corrupt (sha256 {got[:16]}..., meta.json says {want[:16]}...)"
        )
    try:
        starts = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"document index {f} is unreadable ({' '.join(str(e).split())[:80]})") from e
    why = index_problem(starts, int(entry["num_tokens"]))
    if why is None and isinstance(entry.get("num_docs"), int) and starts.shape != (entry["num_docs"],):
        why = f"{starts.size} document starts, meta.json says the shard holds {entry['num_docs']} documents"
    if why:
        raise ValueError(f"document index {f} is corrupt: {why}")
    return starts


def check_prepared(path: str | Path) -> dict:
    """Cheap whole-folder check before training (stat calls and one tokenizer hash): the tokenizer is
    the one the shards were made with, and every shard has the size meta.json records (a truncated or
    missing shard is caught here, before any process group exists). Returns the meta; ValueError else."""
    from megaframe.data.tokenizer import tokenizer_sha256

    path = Path(path)
    meta = read_meta(path)
    tok = inside(path, meta.get("tokenizer", "tokenizer.model"))
    if not tok.exists():
        raise ValueError(f"{tok.name} missing (the tokenizer the shards were made with)")
    want = meta.get("tokenizer_sha256")
    if want and tokenizer_sha256(tok) != want:
        raise ValueError(
            f"{tok.name} does not match the tokenizer the shards were made with "
            "(tokenizer_sha256 in meta.json differs)"
        )
    if not meta.get("meta_sha256") and tok.is_file():  # no checksum vouches for vocab_size: ask the model
        vocab_problem(meta, tok, unloadable_ok=True)
    itemsize = np.dtype(meta["dtype"]).itemsize
    for s in meta["shards"]:
        f = inside(path, s["file"])
        if not f.is_file():
            raise ValueError(f"shard {s['file']} missing")
        if "num_tokens" not in s:
            raise ValueError(f"meta.json is corrupt (shard {s['file']} records no num_tokens)")
        size, want_size = f.stat().st_size, s["num_tokens"] * itemsize
        if size != want_size:
            raise ValueError(
                f"shard {s['file']} has {size} bytes, meta.json says {want_size} (truncated or corrupt)"
            )
        if s.get("docs") and not inside(path, s["docs"]).is_file():
            raise ValueError(f"document index {s['docs']} missing")
    return meta


def vocab_problem(meta: dict, tok: Path, unloadable_ok: bool = False) -> None:
    """ValueError unless the tokenizer `tok` has the vocabulary meta.json records (ids are checked against
    vocab_size, so an edited one must not pass); a sentencepiece model loads in milliseconds. unloadable_ok:
    a tokenizer that does not load is left to `data verify` (training reads no tokenizer)."""
    from megaframe.data.tokenizer import TokenizerError, load_tokenizer

    try:
        size = load_tokenizer(tok).vocab_size
    except TokenizerError as e:
        if unloadable_ok:
            return
        raise ValueError(str(e)) from e
    if size != int(meta["vocab_size"]):
        raise ValueError(
            f"meta.json says vocab_size {meta['vocab_size']}, its tokenizer {tok.name} has {size}"
        )


class CorruptShard(ValueError):
    """A shard holds a token id outside the vocabulary; the message names the shard and token offset."""


def check_token_range(tokens: np.ndarray, vocab: int, folder: Path, file: str, offset: int) -> None:
    """Token ids of a piece read from `file` (starting at token `offset`) lie in [0, vocab).

    Runs on the host for every sample read (a max over seq_length + 1 ids): a corrupt id must stop the
    run on every layout, not be masked by a vocab-parallel embedding (tp > 1) or crash an index (tp = 1)."""
    if tokens.size and int(tokens.max()) >= vocab:
        at = offset + int(np.argmax(tokens >= vocab))
        raise CorruptShard(
            f"data shard {Path(folder) / file} is corrupt: token id {int(tokens[at - offset])} at "
            f"token offset {at} is outside the vocabulary ({vocab}); check it with "
            f"python -m megaframe.data verify {folder}"
        )


def dataset_paths(data_cfg) -> list[tuple[str, str]]:
    """(config key, folder) of every prepared dataset a run reads: each data.blend path, else data.path."""
    if getattr(data_cfg, "stages", None):
        return [
            (f"data.stages[{k}].blend[{i}].path", b.path)
            for k, s in enumerate(data_cfg.stages)
            for i, b in enumerate(s.blend)
        ]
    if data_cfg.blend:
        return [(f"data.blend[{i}].path", b.path) for i, b in enumerate(data_cfg.blend)]
    return [("data.path", data_cfg.path)]


def check_datasets(d: DataConfig, vocab_size: int) -> list[dict]:
    """check_prepared on every dataset of the run, plus: the vocabulary fits model.vocab_size, and blended
    datasets share one tokenizer (mixed token ids would be garbage). ValueError names the config key."""
    metas, first = [], None
    for key, path in dataset_paths(d):
        if not path:
            raise ValueError(f"{key} is empty: point it at a folder written by megaframe.data.prepare")
        try:
            meta = check_prepared(path)
        except NotPrepared:
            # the cause says less
            raise NotPrepared(
                f"{key}={path}: no prepared data (meta.json missing); prepare it with: "
                f"{prepare_command(d, path)}"
            ) from None
        except ValueError as e:
            raise ValueError(f"{key}={path}: {e}") from e
        vocab = int(meta["vocab_size"])
        if vocab > vocab_size:
            raise ValueError(
                f"model.vocab_size={vocab_size} is smaller than the tokenizer "
                f"vocabulary {vocab} of {key}={path}"
            )
        sha = meta.get("tokenizer_sha256")
        if first is None:
            first = (key, sha)
        elif sha != first[1]:
            raise ValueError(f"data.blend: {key} and {first[0]} were prepared with different tokenizers")
        metas.append(meta)
    return metas


def folder_tokenizer(path) -> dict | None:
    """What a checkpoint records of the tokenizer a prepared folder was made with (data/kinds.py:
    tokenizer_identity asks it of a run's first folder); None when the folder cannot be read."""
    try:
        meta = read_meta(Path(path))
        # a name from metadata stays in its folder
        tok = inside(path, meta.get("tokenizer", "tokenizer.model"))
    except ValueError:
        return None
    # where generate / export find the run's tokenizer
    return {
        "sha256": meta.get("tokenizer_sha256"),
        "vocab_size": int(meta["vocab_size"]),
        "kind": meta.get("tokenizer_kind", "sentencepiece"),
        "from": str(tok),
        "path": str(tok.resolve()),
    }


def same_tokenizer(tok: dict, data: dict) -> bool:
    """Whether data prepared with the tokenizer `data` (tokenizer_identity) gives the token ids of the
    checkpoint's tokenizer `tok`: the same content hash, or one `tok` is an exact conversion of (`same_as`:
    an HF export of a megaframe run, imported back, names its run's sentencepiece model); the vocabulary
    size when a hash is missing (an import without tokenizer files)."""
    if tok.get("sha256") and data.get("sha256"):
        return tok["sha256"] == data["sha256"] or data["sha256"] in (tok.get("same_as") or [])
    return tok["vocab_size"] == data["vocab_size"]
