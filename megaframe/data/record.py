"""What a run trained on: one record in every checkpoint, compared at a resume and read by evaluate,
export and generate, so none of them falls back on the data= preset's data.path that a blend or stages run
never read.

The record is the checkpoint's `data` entry (kinds.data_state) with its `tokenizer` entry
(kinds.tokenizer_identity: the tokenizer's resolved path and sha256):
    sources         every prepared dataset the run reads, [{key, path, content_sha256}], first-seen order
                    (the first stage's first dataset, else the first blend source, else data.path, first)
    path            a plain run's data.path; None in a blend or stages run (the preset's path is not read)
    blend, stages   the mixture (paths, weights, stage ends); valid_fraction: the held-out split
Every path is resolved (`Path(p).resolve()`): `x`, `x/`, `./x` and a symlink to x are one dataset.
Checkpoints written before `sources` existed hold the paths as typed and no content hash: their paths are
resolved when compared, their content is not compared.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megaframe.config.schema import DataConfig

CONTENT_KEYS = ("vocab_size", "dtype", "eos_id", "tokenizer_sha256", "num_tokens", "shards")
"""The parts of a prepared meta.json that decide its token stream (not the source files' mtimes or the
source folder's name, which a re-prepare of the same text changes)."""


def resolved(path) -> str:
    """The folder's absolute path with symlinks, `.` and a trailing `/` gone; "" for no path."""
    return str(Path(path).resolve()) if path else ""


def content_sha256(folder) -> str | None:
    """A hash of what a prepared folder's reader reads (its shards' sizes, sha256s and document indexes,
    the tokenizer's sha256, the vocabulary): equal for a copy, different once re-prepared from other text.
    None when the folder has no readable meta.json."""
    from megaframe.data.shards import read_meta

    try:
        meta = read_meta(Path(folder))
    except ValueError:
        return None
    keep = {k: meta.get(k) for k in CONTENT_KEYS}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()


def sources(folders: list[tuple[str, str]]) -> list[dict]:
    """The record's `sources`: every prepared folder a run reads ((config key, folder) pairs, data/kinds.py:
    data_folders), once each, resolved and fingerprinted."""
    out, seen = [], set()
    for key, path in folders:
        where = resolved(path)
        if where and where not in seen:
            seen.add(where)
            out.append({"key": key, "path": where, "content_sha256": content_sha256(path)})
    return out


def _get(x, key):
    return x.get(key) if isinstance(x, dict) else getattr(x, key)


def mixture(blend) -> list[dict]:
    """A blend (config entries or recorded dicts) as recorded: resolved paths and float weights."""
    return [{"path": resolved(_get(b, "path")), "weight": float(_get(b, "weight"))} for b in blend or []]


def schedule(stages) -> list[dict]:
    """data.stages (config entries or recorded dicts) as recorded: ends and resolved mixtures."""
    out = []
    for s in stages or []:
        tokens = _get(s, "until_tokens")
        out.append(
            {
                "until_step": _get(s, "until_step"),
                "until_tokens": None if tokens is None else float(tokens),
                "blend": mixture(_get(s, "blend")),
            }
        )
    return out


def run_folders(meta: dict) -> list[str]:
    """The prepared folders a checkpoint's run read, resolved, the one deciding the tokenizer first; from
    the record, or for a checkpoint written before it from the stages/blend/path it recorded."""
    data = meta.get("data") or {}
    if data.get("sources"):
        return [s["path"] for s in data["sources"] if isinstance(s, dict) and s.get("path")]
    config = (meta.get("config") or {}).get("data") or {}
    stages = data.get("stages") or config.get("stages") or []
    blend = data.get("blend") or config.get("blend") or []
    if stages:
        paths = [b["path"] for s in stages for b in s.get("blend") or []]
    elif blend:
        paths = [b["path"] for b in blend]
    else:  # a plain run: its data.path (the preset's path counts only here, where it was read)
        paths = [config.get("path") or data.get("path")]
    return list(dict.fromkeys(resolved(p) for p in paths if p))


def scored_blend(meta: dict) -> list[dict]:
    """The mixture evaluate scores for a checkpoint by default: its blend, or its last stage's (the data its
    val_loss used); [] for a plain run (its data.path)."""
    data = meta.get("data") or {}
    config = (meta.get("config") or {}).get("data") or {}
    stages = data.get("stages") or config.get("stages") or []
    return mixture(stages[-1]["blend"] if stages else data.get("blend") or config.get("blend") or [])


def held_out_note(ran: float, f: float) -> str:
    """What a validation split of fraction f holds for a run that held out `ran` of the same data."""
    if f <= 0:
        return (
            "these are the run's training samples (the checkpoint trained on this data), not a held-out split"
        )
    return (
        f"the checkpoint trained on this data with data.valid_fraction={ran}: the [valid] split of "
        f"data.valid_fraction={f} holds documents it trained on; only a fraction <= {ran} is held out"
    )


REMAP = "every later position maps to other samples: samples already read would repeat and others be skipped"


def _show_blend(blend: list[dict]) -> str:
    return "[" + ", ".join(f"{b['path']}: {b['weight']:g}" for b in blend) + "]"


def _show_stages(stages: list[dict]) -> str:
    def end(s):
        return (
            f"until_step {s['until_step']}"
            if s["until_step"] is not None
            else f"until_tokens {s['until_tokens']:g}"
            if s["until_tokens"] is not None
            else "open"
        )

    return "[" + "; ".join(f"{end(s)}: {_show_blend(s['blend'])}" for s in stages) + "]"


def kind_change(d: DataConfig, meta: dict) -> list[tuple[str, str, str, str]]:
    """A switch of data.kind (recorded in the checkpoint's config; prepared before it was recorded)."""
    was = str(((meta.get("config") or {}).get("data") or {}).get("kind") or "prepared")
    now = str(getattr(d.kind, "value", d.kind))
    if was == now:
        return []
    # the data stream changes entirely: the step's positions name other samples (or none at all)
    return [
        (
            "data.kind",
            was,
            now,
            f"the run trained on {was} data; this run would train on {now} data from the same step",
        )
    ]


def prepared_changes(
    d: DataConfig, old: dict, dataset_folders: list[tuple[str, str]]
) -> list[tuple[str, str, str, str]]:
    """(config key, recorded, this run's, what it does to the stream) of every change of what a prepared
    run trains on against its record `old` (the checkpoint's `data`): its stages, its blend (paths or
    weights), a plain run's data.path, data.valid_fraction, and the content of a folder at the same path
    (`dataset_folders`: the run's (config key, folder) pairs)."""
    out = []
    was, now = schedule(old.get("stages")), schedule(d.stages)
    if was or now:
        if was != now:
            out.append(("data.stages", _show_stages(was), _show_stages(now), REMAP))
    elif mixture(old.get("blend")) != mixture(d.blend):
        out.append(
            ("data.blend", _show_blend(mixture(old.get("blend"))), _show_blend(mixture(d.blend)), REMAP)
        )
    elif not d.blend and old.get("path") and resolved(old["path"]) != resolved(d.path):
        recorded = {s.get("content_sha256") for s in old.get("sources") or []} - {None}
        # a moved copy of the same data is the same data
        if not recorded or content_sha256(d.path) not in recorded:
            out.append(("data.path", resolved(old["path"]), resolved(d.path), REMAP))
    if "valid_fraction" in old and float(old["valid_fraction"]) != d.valid_fraction:
        ran, f = float(old["valid_fraction"]), d.valid_fraction
        why = (
            held_out_note(ran, f) + ", and the train split's positions map to other samples"
            if f > ran
            else f"documents held out at data.valid_fraction={ran} would be trained on, "
            "and the train split's "
            "positions map to other samples"
        )
        out.append(("data.valid_fraction", str(ran), str(f), why))
    recorded = {s["path"]: s.get("content_sha256") for s in old.get("sources") or [] if isinstance(s, dict)}
    for s in sources(dataset_folders):
        want = recorded.get(s["path"])
        if want and s["content_sha256"] != want:
            key = s["key"].split("[")[0]  # data.blend[1].path -> data.blend: allow_config_change's key
            now = str(s["content_sha256"])[:12]
            out.append(
                (
                    key,
                    f"{s['path']} (content {want[:12]}...)",
                    f"content {now}...",
                    "the folder was prepared again since (other tokens): positions already read now name "
                    "other samples",
                )
            )
    return out


def twice(blend, key: str) -> str | None:
    """Why a blend lists one folder twice (under any spelling), or None: two entries of one folder would be
    two independent streams over the same samples, repeating them before an epoch ends."""
    first: dict[str, int] = {}
    for i, b in enumerate(blend):
        where = resolved(b.path)
        if where in first:
            j = first[where]
            return (
                f"{key}[{i}].path={b.path} is the folder of {key}[{j}].path={blend[j].path} ({where}): "
                "list it once, with the summed weight"
            )
        first[where] = i
    return None
