"""The fields of a prepared folder's meta.json that its readers trust, and the checks that keep them honest.

Every reader (the training data reader, training's start-up check, `python -m megaframe.data verify`, the
data record of a checkpoint) takes meta.json's word for how to read the shards: the token `dtype`, the
`vocab_size` the ids must stay under, each shard's `num_tokens`, its `sha256` and its document index. The
shard sha256s cover the shards' bytes, not how they are read: an edited `dtype` would decode the same bytes
as other numbers. So prepare records `meta_sha256`, the sha256 of meta.json's content without that key, and
every reader compares it (a JSON hash: no shard is read for it). Folders prepared before it was recorded
still load; their fields are held to the rules prepare always kept (below), and `data verify` says so.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

CHECKSUM_KEY = "meta_sha256"
HASHED_FORMAT = "megaframe-tokens-v2"
"""The format whose every shard entry carries a sha256 (v1 folders recorded none)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype prepare writes token ids as for a vocabulary: uint16 halves the shards wherever every id
    fits; little-endian explicitly: shards move between machines."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def meta_sha256(meta: dict) -> str:
    """The sha256 of meta.json's content without its own checksum (sorted keys, compact JSON: the same
    for the dict prepare wrote and the one a reader parses back)."""
    body = {k: v for k, v in meta.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(meta: dict) -> dict:
    """`meta` with its checksum, as prepare writes it."""
    return {**meta, CHECKSUM_KEY: meta_sha256(meta)}


def meta_problem(meta: dict) -> str | None:
    """Why the fields of a parsed meta.json (shard entries already type-checked) cannot be trusted, or
    None: a checksum that does not match, else a field breaking the rules prepare keeps."""
    want = meta.get(CHECKSUM_KEY)
    if want is not None and (not isinstance(want, str) or meta_sha256(meta) != want):
        return (
            f"its content does not match its {CHECKSUM_KEY} (the file was changed after prepare wrote it); "
            "prepare the data again"
        )
    return field_problem(meta)


def field_problem(meta: dict) -> str | None:
    """The rules of the fields readers use, which every prepare kept: the unsigned dtype the vocabulary
    gives, an eos inside it, token counts that add up, shards named once and in stream order (prepare names
    them by position), and a sha256 for every shard of the format that records them."""
    vocab = meta["vocab_size"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return f"vocab_size {vocab!r} is not a positive whole number"
    dtype, want = np.dtype(meta["dtype"]), token_dtype(vocab)
    if dtype != want:
        return (
            f"dtype {meta['dtype']!r} is not how prepare writes the ids of a {vocab}-token vocabulary "
            f"({want.name})"
        )
    eos = meta.get("eos_id")
    if eos is not None and not (isinstance(eos, int) and 0 <= eos < vocab):
        return f"eos_id {eos!r} is outside the vocabulary ({vocab})"
    shards = meta["shards"]
    for i, s in enumerate(shards):
        if s.get("num_tokens", 0) < 0 or not isinstance(s.get("num_docs", 0), int):
            return f"shards[{i}] ({s['file']}) records a negative token count or a bad document count"
        if meta.get("format") == HASHED_FORMAT and not s.get("sha256"):
            return f"shards[{i}] ({s['file']}) records no sha256, which every shard of {HASHED_FORMAT} has"
    names = [s["file"] for s in shards]
    for i in range(1, len(names)):
        if names[i] <= names[i - 1]:
            return f"shards[{i}] ({names[i]}) does not come after shards[{i - 1}] ({names[i - 1]})"
    for key, part in (("num_tokens", "num_tokens"), ("num_documents", "num_docs")):
        if key in meta and all(part in s for s in shards):
            total = sum(s[part] for s in shards)
            if meta[key] != total:
                return f"{key} {meta[key]!r} is not the sum of its shards' {part} ({total})"
    return None
