"""Source files of a corpus: find them, fingerprint them, screen them, and stream their documents.

data.source is a folder (every file under it whose name ends in one of data.extensions, optionally
followed by .gz, plus extension-less files whose head is text; recursively, sorted, hidden entries
skipped), a glob, or one file. Files are read with the `datasets` library in streaming mode (bounded
memory; compressed files are decompressed on the fly), offline and with its cache in a temp folder, so a
fresh machine needs no network and no ~/.cache.

Documents: a jsonl/json/parquet record's data.text_key field is one document. A plain-text file is one
document (data.split=file: code, web pages) or one per blank-line separated paragraph
(data.split=paragraph: books; the demo corpus). Documents are stripped of surrounding whitespace; empty
ones are skipped.

Binary garbage (a renamed image, a corrupt download) is refused twice over: the head of every text/json
file is screened before anything is written (naming the exact file), and every streamed batch is
screened again (undecodable bytes become U+FFFD, which is then counted).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

RECORD_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BATCH_DOCS = 1024
HEAD_BYTES = 64 * 1024
SNIFF_BYTES = 8 * 1024
MAX_BAD_FRACTION = 0.05
"""More than this fraction of undecodable or control characters means binary data, not text; real text
in a wrong encoding (latin-1 read as UTF-8) stays well under it."""
# C0 controls except tab, newline, vertical tab, form feed and
# carriage return (\x09-\x0d, common in text), DEL and U+FFFD
_BAD_CHARS = re.compile("[\x00-\x08\x0e-\x1f\x7f\ufffd]")


class PrepareError(ValueError):
    """Bad input (source, text, tokenizer, existing output); prepare's main() turns it into exit code 2."""


@dataclass(frozen=True)
class SourceFile:
    path: Path
    rel: str
    """The path relative to the source root: what the manifest records and compares."""
    size: int
    mtime_ns: int
    kind: str = "text"
    """text | json | parquet: how the file is read (not recorded: it follows from the name)."""

    def record(self, sha256: str) -> dict:
        d = asdict(self)
        d.pop("path")
        d.pop("kind")
        return {**d, "sha256": sha256}


def kind_of(path: Path, extensions: list[str] | tuple[str, ...]) -> str | None:
    """How to read `path`: by its ending among `extensions` (a .gz after it is allowed, not for parquet),
    by sniffing when it has no extension at all, else None (skipped)."""
    name = path.name.lower()
    base = name[:-3] if name.endswith(".gz") else name
    # longest first: of several endings a name matches, the most specific decides how it is read
    endings = sorted(
        (e.lower() if e.startswith(".") else "." + e.lower() for e in extensions), key=len, reverse=True
    )
    for ext in endings:
        if base.endswith(ext) and not (ext == ".parquet" and base != name):
            return RECORD_KINDS.get(ext, "text")
    if not extension_of(base) and looks_like_text(path):
        return "text"  # Makefile, LICENSE, README, scripts without an extension; libglib2.0-0__copyright
    return None


def extension_of(name: str) -> str:
    """The name's extension, '' when it has none: what follows the last dot counts only when it looks like
    one (1-10 letters or digits), so in `libglib2.0-0__copyright` the dot is part of a version."""
    stem, dot, ext = name.lstrip(".").rpartition(".")
    return f".{ext.lower()}" if dot and stem and re.fullmatch(r"[A-Za-z0-9]{1,10}", ext) else ""


def looks_like_text(path: Path) -> bool:
    """The head of a file decodes as UTF-8 text: no NUL byte, few undecodable or control characters."""
    try:
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        with opener(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except (OSError, EOFError):
        return False
    text = head.decode("utf-8", errors="replace")
    return bool(head) and b"\x00" not in head and bad_fraction(text) <= MAX_BAD_FRACTION


def resolve_source(
    source: str,
    extensions: list[str] | tuple[str, ...] = (*RECORD_KINDS, ".txt"),
    exclude: tuple[Path, ...] = (),
) -> list[SourceFile]:
    """The input files of data.source, sorted, less those under `exclude` (prepare's own output folders);
    raises PrepareError when there are none."""
    if not source:
        raise PrepareError(
            "data.source is empty: set it to a folder or glob of text, code, .jsonl or .parquet files"
        )
    root, candidates = _candidates(source, exclude)
    # sorted: the token stream (file order) must not depend on the file system's listing order
    files = sorted((p, k) for p in candidates if p.is_file() and (k := kind_of(p, extensions)))
    if not files:
        raise PrepareError(
            f"data.source={source}: no files ending in data.extensions "
            f"({', '.join(extensions[:8])}, ...) and no extension-less text files found"
        )
    out = []
    for f, kind in files:
        st = f.stat()
        out.append(SourceFile(f, os.path.relpath(f, root), st.st_size, st.st_mtime_ns, kind))
    return out


def _candidates(source: str, exclude: tuple[Path, ...] = ()) -> tuple[Path, list[Path]]:
    """The root of data.source and every path under it that could be an input (hidden entries and those
    under `exclude` left out)."""
    root, found = _listed(source)
    if not exclude:
        return root, found
    # compared resolved: the output may be named through a symlink or a relative path
    skip = [os.path.realpath(e) + os.sep for e in exclude]
    return root, [p for p in found if not any(os.path.realpath(p).startswith(e) for e in skip)]


def _listed(source: str) -> tuple[Path, list[Path]]:
    path = Path(source)
    if any(c in source for c in "*?["):
        prefix = re.split(r"[*?\[]", source)[0]  # the glob's literal head: its folder is the root
        root = Path(prefix) if prefix.endswith(os.sep) else Path(prefix).parent
        return root, [Path(p) for p in glob.glob(source, recursive=True)]
    if path.is_dir():
        return path, [
            p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
    if path.exists():
        return path.parent, [path]
    raise PrepareError(f"data.source={source} does not exist")


def skipped(source: str, files: list[SourceFile], exclude: tuple[Path, ...] = ()) -> dict[str, list[str]]:
    """The files of data.source that give no document, by reason: an ending not in data.extensions (the
    ending, e.g. '.debian'), 'not text' (no extension, binary head) or 'empty'. Hidden entries are not
    listed."""
    root, candidates = _candidates(source, exclude)
    taken = {f.path for f in files}
    out: dict[str, list[str]] = {}
    for p in sorted(c for c in candidates if c.is_file() and c not in taken):
        base = p.name[:-3] if p.name.lower().endswith(".gz") else p.name
        out.setdefault(extension_of(base) or "not text", []).append(os.path.relpath(p, root))
    for f in files:
        if f.size == 0:
            out.setdefault("empty", []).append(f.rel)
    return out


def skip_line(groups: dict[str, list[str]], total: int) -> str | None:
    """One line for prepare's output: how many files were skipped and why, most common reason first."""
    n = sum(len(v) for v in groups.values())
    if not n:
        return None
    parts = [f"{len(v)} x {k}" for k, v in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    shown = ", ".join(parts[:6]) + (f", {len(parts) - 6} more endings" if len(parts) > 6 else "")
    # the endings hint only where an ending was skipped: empty files have nothing to read
    hint = "add endings to data.extensions to read them; " if set(groups) - {"empty"} else ""
    return (
        f"megaframe: prepare: skipped {n} of {total + n - len(groups.get('empty', []))} files ({shown}); "
        f"{hint}the names are in meta.json's `skipped`"
    )


def text_size(src: SourceFile) -> int:
    """About how many bytes of text the file holds, for the progress bar: a .gz file's trailer records
    its uncompressed size (mod 4 GiB), a parquet footer its row groups' uncompressed sizes."""
    try:
        if src.path.name.lower().endswith(".gz") and src.size >= 18:
            with open(src.path, "rb") as f:
                f.seek(-4, os.SEEK_END)
                # max with the compressed size: ISIZE wraps at 4 GiB, so a huge file could read small
                return max(src.size, int.from_bytes(f.read(4), "little"))
        if src.kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(src.path).metadata
            return max(src.size, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
    except (OSError, ValueError):  # an estimate only (ArrowInvalid is a ValueError); the real read reports
        pass
    return src.size


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # 1 MiB blocks: bounded memory
            h.update(block)
    return h.hexdigest()


def bad_fraction(text: str) -> float:
    return len(_BAD_CHARS.findall(text)) / max(1, len(text))


def screen_head(src: SourceFile) -> None:
    """Refuse a text/json file whose first bytes are binary (parquet is binary by design: skipped)."""
    if src.kind == "parquet":
        return
    try:
        opener = gzip.open if src.path.name.lower().endswith(".gz") else open
        with opener(src.path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except (OSError, EOFError) as e:
        raise PrepareError(f"cannot read {src.path}: {' '.join(str(e).split())}") from e
    if b"\x00" in head or bad_fraction(head.decode("utf-8", errors="replace")) > MAX_BAD_FRACTION:
        raise PrepareError(f"{src.path}: binary data, not UTF-8 text")


def units(files: list[SourceFile], unit_bytes: int) -> list[list[SourceFile]]:
    """Consecutive files of one kind, packed up to ~unit_bytes: the unit of work a re-run can skip.

    Grouping keeps the number of `datasets` loader calls (~30 ms each) and of done-records small on a
    corpus of many small files; it depends only on the sorted files and their sizes, so it is stable.
    """
    out: list[list[SourceFile]] = []
    size = 0
    for f in files:
        # one kind per unit: a unit is one `datasets` loader call, which reads one format
        if out and out[-1][0].kind == f.kind and size + f.size <= unit_bytes:
            out[-1].append(f)
            size += f.size
        else:
            out.append([f])
            size = f.size
    return out


def _where(group: list[SourceFile]) -> str:
    return str(group[0].path) if len(group) == 1 else f"{group[0].path} (+{len(group) - 1} more)"


def iter_documents(
    group: list[SourceFile], text_key: str, cache_dir: str, split: str = "paragraph"
) -> Iterator[list[str]]:
    """Batches of non-empty, stripped documents of files of ONE kind, in file order.

    Read errors, a missing text field and binary content become PrepareError naming the files.
    """
    import datasets
    from datasets.exceptions import DatasetsError
    from pyarrow.lib import ArrowException

    datasets.utils.logging.set_verbosity(50)  # CRITICAL: read errors are reported once, by us
    datasets.disable_progress_bars()
    kind = group[0].kind
    by = "document" if split == "file" else "paragraph"  # a text file is one document, or its paragraphs
    extra = {"sample_by": by, "encoding_errors": "replace"} if kind == "text" else {}
    key = "text" if kind == "text" else text_key
    try:
        ds = datasets.load_dataset(
            kind,
            data_files=[str(f.path) for f in group],
            split="train",
            streaming=True,
            cache_dir=cache_dir,
            **extra,
        )
        for batch in ds.iter(batch_size=BATCH_DOCS):
            if key not in batch:
                raise PrepareError(f"{_where(group)}: records have no field {key!r} (set data.text_key)")
            # a null or non-string field is skipped like an empty document, not an error
            docs = [d for d in (t.strip() for t in batch[key] if isinstance(t, str)) if d]
            if docs and bad_fraction("".join(docs)) > MAX_BAD_FRACTION:
                raise PrepareError(f"{_where(group)}: binary data, not UTF-8 text")
            yield docs
    except PrepareError:
        raise
    # unreadable input: name the files, one line
    except (
        OSError,
        ValueError,
        DatasetsError,
        ArrowException,
    ) as e:
        raise PrepareError(
            f"cannot read {_where(group)}: {' '.join(str(e).split()) or type(e).__name__}"
        ) from e


def sample_documents(
    files: list[SourceFile], text_key: str, cache_dir: str, budget: int, split: str = "paragraph"
) -> Iterator[str]:
    """Documents for tokenizer training: all of them, or ~`budget` characters spread over the corpus.

    With a budget smaller than the corpus, evenly spaced files are read, each up to an equal share of
    the budget: about four times as many files as the budget could hold whole, a quarter of each, so the
    sample covers the whole sorted file list without reading it all; deterministic.
    """
    total = sum(f.size for f in files)
    if budget <= 0 or budget >= total:
        for group in units(files, 1 << 62):
            for batch in iter_documents(group, text_key, cache_dir, split):
                yield from batch
        return
    n = len(files)
    # 4x the files the budget holds whole, a quarter of each: the sample spans the whole sorted list
    k = min(n, 4 * math.ceil(n * budget / total))
    picks = sorted({j * n // k for j in range(k)})  # evenly spaced, deterministic
    share = budget // len(picks)
    for i in picks:
        taken = 0
        batches = iter_documents([files[i]], text_key, cache_dir, split)
        with contextlib.closing(batches):
            for batch in batches:
                for d in batch:
                    yield d
                    taken += len(d)
                    if taken >= share:
                        break
                if taken >= share:
                    break


@contextlib.contextmanager
def offline_hf(cache_dir: str):
    """No network and no ~/.cache for `datasets`; the
    environment is restored afterwards (tests run in-process)."""
    env = {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": cache_dir,
        "HF_DATASETS_CACHE": cache_dir,
    }
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
