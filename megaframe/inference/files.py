"""What generation and evaluation read from a run: the checkpoint folder and the run's tokenizer."""
from __future__ import annotations

import json
from pathlib import Path


def resolve_step(path: str | Path) -> tuple[Path, dict]:
    """(step folder, metadata) of a step folder or a checkpoint dir (its newest committed step).
    ValueError names what is missing."""
    from megaframe.checkpoint import sharded

    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: no such checkpoint")
    if not (p / "metadata.json").is_file():
        # a checkpoint dir: its newest complete step (metadata and sizes checked, no shard bytes read)
        p = sharded.latest(p)
        if p is None:
            raise ValueError(f"{path}: no committed checkpoint (no step folder with metadata.json)")
    try:
        return p, sharded.read_metadata(p)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{p}: unreadable metadata.json ({e})") from e


def tokenizer_candidates(step: Path, meta: dict) -> list[Path]:
    """Where a run's tokenizer may be, best first: the path the checkpoint records (trainer: meta
    "tokenizer"), the prepared data's tokenizer (data.path, then blend sources), and the copy an HF
    import leaves beside its checkpoint (hf_tokenizer/)."""
    out = []
    rec = meta.get("tokenizer") or {}
    if rec.get("path"):  # exactly the tokenizer the run trained with
        out.append(Path(rec["path"]))
    data = (meta.get("config") or {}).get("data") or {}
    for folder in [data.get("path")] + [b.get("path") for b in data.get("blend") or []]:
        if not folder:
            continue
        name = "tokenizer.model"
        try:
            name = json.loads((Path(folder) / "meta.json").read_text()).get("tokenizer", name)
        except (OSError, ValueError, AttributeError):
            pass
        out.append(Path(folder) / name)
    out += [step.parent / "hf_tokenizer", step.parent.parent / "hf_tokenizer"]
    return out


def find_tokenizer(step: Path, meta: dict, given: str | None = None):
    """The loaded tokenizer of the run (or `given`); ValueError when none can be found."""
    from megaframe.data.tokenizer import TokenizerError, load_tokenizer

    paths = [Path(given)] if given else tokenizer_candidates(step, meta)
    for p in paths:
        if p.exists():
            try:
                return load_tokenizer(p), p
            except TokenizerError as e:
                # a tokenizer that exists but fails to load stops here: falling back could decode with another vocabulary
                raise ValueError(str(e)) from e
    raise ValueError(f"no tokenizer found for {step} (looked at {', '.join(map(str, paths)) or 'nothing'}); "
                     "pass --tokenizer PATH")


def tokenizer_record(data_cfg) -> dict | None:
    """What a checkpoint records about the run's tokenizer: the prepared data's tokenizer path and hash."""
    from megaframe.data.shards import dataset_paths

    for _, folder in dataset_paths(data_cfg):
        if not folder:
            continue
        try:
            meta = json.loads((Path(folder) / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        tok = Path(folder) / meta.get("tokenizer", "tokenizer.model")
        if tok.exists():
            return {"path": str(tok.resolve()), "sha256": meta.get("tokenizer_sha256")}
    return None
