"""What generation and evaluation read from a run: the checkpoint folder and the run's tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from megaframe.paths import inside


def resolve_step(path: str | Path) -> tuple[Path, dict]:
    """(step folder, metadata) of a step folder or a checkpoint dir (what its `latest` names).
    ValueError names what is missing."""
    from megaframe.checkpoint import resolve, sharded

    # a checkpoint dir: the checkpoint `latest` names (the live branch after a rollback), not the highest step
    p = resolve.step_folder(path)
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
            # a name from metadata stays inside its folder (OutsideFolder is a ValueError: the default name)
            name = inside(folder, json.loads((Path(folder) / "meta.json").read_text()).get("tokenizer", name)).name
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
            tok = inside(folder, meta.get("tokenizer", "tokenizer.model"))
        except (OSError, ValueError, AttributeError):
            continue
        if tok.exists():
            return {"path": str(tok.resolve()), "sha256": meta.get("tokenizer_sha256")}
    return None
