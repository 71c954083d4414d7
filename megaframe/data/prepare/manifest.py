"""What a prepared folder was made from, so a re-run can skip finished work and refuse changed input.

meta.json is the manifest (written last, so its presence marks the folder complete):
  settings   what decides the tokens besides the text: the format, data.text_key, and the tokenizer
             (trained: data.vocab_size + data.tokenizer_sample_bytes; given: data.tokenizer's content hash)
  sources    every source file: path relative to the source root, size, mtime_ns, sha256
  tokenizer, tokenizer_sha256, vocab_size, eos_id, dtype, num_tokens, num_documents, shards
A re-run compares settings and sources with meta.json: identical -> nothing to do; different -> refused
(exit 2), never rebuilt over good data. Sizes and mtimes are compared first; a file whose mtime moved
is hashed, so `touch` or a copy does not count as a change but an edit does.

While preparing, the same facts live in the hidden partial folder beside data.path: settings.json,
the tokenizer, and one units/unit_NNNNN.json per finished work unit (its files' records and shards);
an interrupted run resumes there, redoing only units whose record is missing or whose files changed.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaframe.atomic import write_atomic
from megaframe.data.prepare.sources import PrepareError, SourceFile, file_sha256

FORMAT = "megaframe-tokens-v2"


def write_json(path: Path, obj) -> None:
    """Write-then-rename: a reader sees the old file or the whole new one, never half."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def settings_of(data_cfg, given_sha256: str | None) -> dict:
    if given_sha256 is not None:
        tok = {"given_sha256": given_sha256}
    else:
        tok = {
            "train_vocab_size": int(data_cfg.vocab_size),
            "train_sample_bytes": int(data_cfg.tokenizer_sample_bytes),
        }
    return {
        "format": FORMAT,
        "text_key": data_cfg.text_key,
        "split": _split_name(data_cfg.split),
        "tokenizer": tok,
    }


def _split_name(split) -> str:
    return getattr(split, "value", split)


def _with_old_defaults(settings: dict) -> dict:
    """Settings recorded before data.split existed: text files were read as paragraphs then."""
    return {"split": "paragraph", **settings} if "format" in settings else settings


def describe_settings_change(old: dict, new: dict) -> str:
    o, n = old.get("tokenizer", {}), new["tokenizer"]
    if old.get("format") != new["format"]:
        return f"format {old.get('format')} (this version writes {new['format']})"
    if old.get("split", "paragraph") != new["split"]:
        return f"data.split={new['split']} (it was made with data.split={old.get('split', 'paragraph')})"
    if old.get("text_key") != new["text_key"]:
        return f"data.text_key={new['text_key']!r} (it was made with {old.get('text_key')!r})"
    if "given_sha256" in n or "given_sha256" in o:
        return "data.tokenizer is not the tokenizer it was made with"
    if o.get("train_vocab_size") != n["train_vocab_size"]:
        return (
            f"data.vocab_size={n['train_vocab_size']} (its "
            f"tokenizer was trained with {o.get('train_vocab_size')})"
        )
    return (
        f"data.tokenizer_sample_bytes={n['train_sample_bytes']} "
        f"(its tokenizer was trained with {o.get('train_sample_bytes')})"
    )


def same_file(old: dict, f: SourceFile) -> bool:
    """Same content as a recorded file: equal size, and equal mtime or (if it moved) equal sha256."""
    if old["size"] != f.size:
        return False
    # mtime first: hashing every source on every re-run would read the whole corpus
    return old["mtime_ns"] == f.mtime_ns or old["sha256"] == file_sha256(f.path)


def source_change(old: list[dict], files: list[SourceFile]) -> str | None:
    """A readable reason when `files` differ from the recorded sources, else None."""
    recorded = {r["rel"]: r for r in old}
    current = {f.rel: f for f in files}
    # sorted: a re-run names the same file as the reason every time
    for rel in sorted(recorded.keys() - current.keys()):
        return f"source file {rel} is gone"
    for rel in sorted(current.keys() - recorded.keys()):
        return f"source file {rel} is new"
    for rel in sorted(current):
        if not same_file(recorded[rel], current[rel]):
            return f"source file {rel} changed"
    return None


def check_existing(out: Path, meta: dict, settings: dict, files: list[SourceFile]) -> None:
    """Raise PrepareError unless the prepared `out` was made from exactly these settings and files."""
    if meta.get("format") == "megaframe-tokens-v1":
        return  # made before manifests existed: nothing to compare, and never rebuilt
    why = None
    if _with_old_defaults(meta.get("settings") or {}) != settings:
        why = describe_settings_change(meta.get("settings") or {}, settings)
    else:
        why = source_change(meta.get("sources", []), files)
    if why:
        raise PrepareError(
            f"data.path={out} was prepared from other input: {why}; refusing to overwrite it "
            "(pick another data.path, or delete it to rebuild)"
        )


def unit_record_path(work: Path, k: int) -> Path:
    return work / "units" / f"unit_{k:05d}.json"


def finished_unit(work: Path, k: int, records: list[dict]) -> dict | None:
    """The record of unit k from an earlier run, if its files are unchanged and its shards all there."""
    path = unit_record_path(work, k)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None

    def content(rs):  # a touched but unchanged file (new mtime, same hash) keeps its unit
        return [{k: v for k, v in r.items() if k != "mtime_ns"} for r in rs]

    if content(rec.get("files", [])) != content(records):
        return None
    # a record whose shards were removed by hand redoes the unit rather than trusting it
    if not all((work / s["file"]).is_file() and (work / s["docs"]).is_file() for s in rec["shards"]):
        return None
    return rec
