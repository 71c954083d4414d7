"""What generation and evaluation read from a run: the checkpoint folder and the run's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, TypeVar

from megaframe.paths import inside

T = TypeVar("T")


def resolve_step(path: str | Path) -> tuple[Path, dict]:
    """(step folder, metadata) of a step folder or a checkpoint dir (what its `latest` names).
    ValueError names what is missing."""
    from megaframe.checkpoint import resolve

    # a checkpoint dir: the checkpoint `latest` names (the live branch after a rollback), not the highest step
    p = resolve.step_folder(path)
    return p, step_metadata(p)


def step_metadata(step: Path) -> dict:
    from megaframe.checkpoint import sharded

    try:
        return sharded.read_metadata(step)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{step}: unreadable metadata.json ({e})") from e


def read_step(path: str | Path, read: Callable[[Path, dict], T]) -> tuple[Path, dict, T]:
    """(step folder, metadata, read(step folder, metadata)) of a step folder or checkpoint dir; everything a
    tool reads of the step goes in `read`: a live run that prunes the step meanwhile makes it read the new
    `latest` (megaframe.checkpoint.resolve.read_newest)."""
    from megaframe.checkpoint import resolve

    def both(step: Path) -> tuple[dict, T]:
        meta = step_metadata(step)
        return meta, read(step, meta)

    step, (meta, got) = resolve.read_newest(path, both)
    return step, meta, got


def tokenizer_candidates(step: Path, meta: dict) -> list[Path]:
    """Where a run's tokenizer may be, best first: the path the checkpoint records (trainer: meta "tokenizer";
    an HF import: its "from"), the tokenizers of the datasets the run read (megaframe.data.record.run_folders:
    its stages' or blend's sources, data.path only in a plain run), and the copy an HF import leaves beside
    its checkpoint (hf_tokenizer/)."""
    from megaframe.data.record import run_folders

    out = []
    rec = meta.get("tokenizer") or {}
    for key in ("path", "from"):  # exactly the tokenizer the run trained with
        if isinstance(rec.get(key), str) and rec[key]:
            out.append(Path(rec[key]))
    for folder in run_folders(meta):
        name = "tokenizer.model"
        try:
            # a name from metadata stays inside its folder (OutsideFolder is a ValueError: the default name)
            name = inside(
                folder, json.loads((Path(folder) / "meta.json").read_text()).get("tokenizer", name)
            ).name
        except (OSError, ValueError, AttributeError):
            pass
        out.append(Path(folder) / name)
    out += [step.parent / "hf_tokenizer", step.parent.parent / "hf_tokenizer"]
    return list(dict.fromkeys(out))


TOKENIZER_OPTION = "--tokenizer PATH"
"""How generate and export name their tokenizer option; evaluate and the lm-eval model pass their own."""


def tokenizer_path(
    step: Path, meta: dict, given: str | None = None, option: str = TOKENIZER_OPTION
) -> Path | None:
    """The run's tokenizer file or folder (or `given`, taken as is): the first candidate that exists and, when
    the checkpoint records its tokenizer's sha256, has that sha256 (or one it is an exact conversion of): a
    fallback of another vocabulary would decode every id wrong. None when no candidate exists; ValueError
    when some exist but none has the recorded sha256."""
    from megaframe.data.tokenizer import tokenizer_sha256

    if given:
        return Path(given)
    rec = meta.get("tokenizer") or {}
    want = {rec.get("sha256"), *(rec.get("same_as") or [])} - {None}
    other = []
    for p in tokenizer_candidates(step, meta):
        if not p.exists():
            continue
        if not want or tokenizer_sha256(p) in want:
            return p
        other.append(str(p))
    if other:
        sha = sorted(want)[0][:16]
        raise ValueError(
            f"no tokenizer of {step} has the sha256 its checkpoint records ({sha}...): "
            f"{', '.join(other)} differ (another tokenizer); pass the run's tokenizer with {option}"
        )
    return None


def find_tokenizer(step: Path, meta: dict, given: str | None = None, option: str = TOKENIZER_OPTION):
    """The loaded tokenizer of the run (or `given`) and its path; ValueError when none can be found, its
    hint naming `option`, the tool's own way to give one (a hint naming another tool's flag misled)."""
    from megaframe.data.tokenizer import TokenizerError, load_tokenizer

    p = tokenizer_path(step, meta, given, option)
    if p is None or not p.exists():
        looked = [Path(given)] if given else tokenizer_candidates(step, meta)
        where = ", ".join(map(str, looked)) or "nothing"
        raise ValueError(f"no tokenizer found for {step} (looked at {where}); pass {option}")
    try:
        return load_tokenizer(p), p
    except TokenizerError as e:
        # a tokenizer that exists but fails to load stops here: a fallback could decode with other ids
        raise ValueError(str(e)) from e


def check_vocab(tok, tok_path, vocab_size: int) -> None:
    """Every tool that scores or generates with a tokenizer: one with more ids than the model's embedding
    rows is refused before any text is encoded (its high ids indexed past the table: an IndexError in
    torch.embedding in the middle of lm-eval's scoring). ValueError names both sizes."""
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tok.vocab_size} tokens > model.vocab_size={vocab_size}")


def tokenizer_record(data_cfg) -> dict | None:
    """What a checkpoint records about the run's tokenizer: the prepared data's tokenizer path and hash."""
    from megaframe.data.kinds import data_folders

    for _, folder in data_folders(data_cfg):
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
