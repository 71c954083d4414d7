"""The one answer to "which checkpoint does this path mean", for resume, load_model, generate, evaluate,
export_hf and the config checks.

A step folder means itself. A checkpoint dir means the checkpoint `latest` names (the live branch after a
rollback: checkpoint/lineage.py), never the highest step number, which may belong to an abandoned branch.
When `latest` cannot be trusted (missing, garbage, or naming a folder whose metadata is unreadable) the
lineage is unknown: the checkpoints are then used only if they form one branch (exactly one of them is no
other's ancestor), with a warning; several branches are refused, naming their newest checkpoints, so the
user picks one (checkpoint.resume=PATH, or the step folder itself).
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Callable, TypeVar

from megaframe.checkpoint import lineage
from megaframe.checkpoint.metadata import CheckpointError, committed
from megaframe.checkpoint.metadata import read as read_metadata

T = TypeVar("T")

READ_TRIES = 3
"""How many newest checkpoints a tool tries to read while a live run prunes them (checkpoint.keep_last):
each try starts on the `latest` of that moment, so one more save per read must outpace it every time."""


class Unresolved(CheckpointError):
    """A checkpoint dir whose live branch cannot be told (bad input: exit 2 naming the choices)."""


def _warn(msg: str) -> None:
    print(f"megaframe: warning: {msg}", file=sys.stderr, flush=True)


def pointer_problem(root: str | Path) -> str | None:
    """Why `${root}/latest` names no readable checkpoint, or None when it does."""
    try:
        name = (Path(root) / "latest").read_text(errors="replace").strip()
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    shown = name if len(name) <= 60 else name[:57] + "..."
    head = lineage.pointed(root)
    if head is None and name and "/" not in name and (Path(root) / name).is_dir():
        # a folder whose metadata.json (written last, at the commit) is gone or was never written
        return f"names {shown!r}, whose metadata.json is missing (a save that never committed, or deleted)"
    if head is None:
        return f"names {shown!r}, which is not a step folder here"
    try:
        read_metadata(head)
    except (OSError, ValueError) as e:  # the reason (damaged how) without the path the message already names
        why = str(e).removeprefix(f"{head}: ")
        return f"names {head.name}, whose metadata.json cannot be used ({why})"
    return None


def heads(root: str | Path) -> list[Path]:
    """Committed checkpoints with readable metadata that are no other one's parent, newest step first:
    the tips of the branches."""
    found = {p: m for p in committed(root) if (m := lineage._meta(p)) is not None}
    parents = {lineage.parent_of(p, m, root) for p, m in found.items()}
    parents = {q.resolve() for q in parents if q is not None}
    tips = [p for p in found if p.resolve() not in parents]
    return sorted(tips, key=lambda p: (found[p].get("step", -1), p.name), reverse=True)


def head(root: str | Path, warn=_warn) -> Path | None:
    """The checkpoint a checkpoint dir continues: what `latest` names, else its only branch's tip; None
    when it holds no committed checkpoint; Unresolved when `latest` is unusable and there are branches."""
    why = pointer_problem(root)
    if why is None:
        return lineage.pointed(root)
    tips = heads(root)
    if not tips:
        return None
    if len(tips) == 1:
        warn(f"{Path(root) / 'latest'} {why}; its checkpoints form one branch: using its newest, {tips[0]}")
        return tips[0]
    names = ", ".join(f"{p.name} (run {_run(p)})" for p in tips[:5]) + (", ..." if len(tips) > 5 else "")
    raise Unresolved(
        f"{root}: `latest` {why}; its checkpoints form {len(tips)} branches (newest of each: "
        f"{names}) and the highest step may be an abandoned one, so none is picked: name the step "
        f"folder to use (checkpoint.resume={Path(root)}/step_XXXXXXXX, or that path to the tool)"
    )


def _run(path: Path) -> str:
    return str(((lineage._meta(path) or {}).get("lineage") or {}).get("run_id", "?"))


def step_folder(path: str | Path, warn=_warn) -> Path:
    """A step folder for a step folder or checkpoint dir; CheckpointError (a ValueError) naming the path."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if (p / "metadata.json").is_file():
        return p
    found = head(p, warn)
    if found is None:
        raise CheckpointError(f"{path}: no committed checkpoint (no step folder with metadata.json)")
    return found


def resume_order(root: str | Path, warn=_warn) -> list[Path]:
    """What resume=auto tries, in order: the head and its ancestors (a load that fails moves to the
    parent); never another branch. Empty when the dir holds no checkpoint; Unresolved as `head`."""
    found = head(root, warn)
    return lineage.chain(found, root) if found is not None else []


def _not_found(e: BaseException) -> bool:
    """Whether `e` (or what it wraps) says a file is gone: an OSError ENOENT, safetensors' own error, or
    our `no such checkpoint`."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOENT:
            return True
        if "No such file or directory" in str(e) or "no such checkpoint" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def vanished(step: Path, e: BaseException) -> bool:
    """Whether reading `step` failed because the folder was deleted under the reader (a live run's
    checkpoint.keep_last prunes by deleting whole step folders): a file it reads is gone and the folder
    no longer holds a committed checkpoint, or the error is that a file is gone and the folder is going."""
    gone = not (step / "metadata.json").is_file()
    return gone or (_not_found(e) and lineage.cheap_check(step) is not None)


def read_newest(path: str | Path, read: Callable[[Path], T], warn=_warn, step: Path | None = None):
    """(step folder, read(step folder)) for the checkpoint `path` means (step_folder). A checkpoint dir is
    live while a run saves into it: when the step read is pruned mid-read, `latest` is resolved again and
    the new step read, up to READ_TRIES times, with a warning each time; then a CheckpointError that says
    a live run pruned it. A step folder named itself and deleted mid-read is a CheckpointError saying so.
    Any other failure of `read` is raised as is."""
    root = Path(path)
    step = step or step_folder(root, warn)
    for _ in range(READ_TRIES):
        try:
            return step, read(step)
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # what a read of removed files raises
            if not vanished(step, e):
                raise
            if root.resolve() == step.resolve():  # the user named this step: no newer one to read
                raise CheckpointError(
                    f"{step}: deleted while it was read (a live run pruning it: checkpoint.keep_last); pass "
                    "its checkpoint dir to read the newest checkpoint"
                ) from None
            newer = step_folder(root, warn)
            if newer.resolve() == step.resolve():
                raise
            warn(f"{step.name} was pruned by a live run while it was read; reading the new latest, {newer}")
            step = newer
    raise CheckpointError(
        f"{root}: the checkpoint `latest` named was pruned by a live run while it was read, {READ_TRIES} "
        "times in a row (checkpoint.keep_last); name a step folder the run keeps, or read after it ends"
    )
