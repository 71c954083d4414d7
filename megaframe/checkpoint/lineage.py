"""Checkpoint lineage: which checkpoint a run resumed from, and which of them `resume=auto` and
`checkpoint.keep_last` may touch.

Every checkpoint's metadata.json carries
    "lineage": {"id": "<run id>:<step>", "run_id": ..., "parent": <folder name, or an absolute path
                outside checkpoint.dir, or null>, "parent_id": <the parent's lineage id, or null>}
where the parent is the checkpoint this run resumed from. The chain of parents from a checkpoint is its
lineage. A rollback (resuming from an older step, the usual answer to a loss spike) starts a new branch:
its checkpoints name the older one as parent, while the abandoned branch's newer steps are on no path
from the new ones. Hence:
- `resume=auto` follows `${checkpoint.dir}/latest` (replaced atomically after each commit), then that
  checkpoint's ancestors, never the highest step number, which may belong to an abandoned branch;
- `keep_last=N` deletes only ancestors of the newest checkpoint beyond the N newest of its chain; other
  branches and anything outside checkpoint.dir are never deleted (a person decides about them).
A parent link whose folder now holds another checkpoint (a branch rewrote that step) has a different id:
the chain stops there, so nothing of another branch is taken for ours.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megaframe.checkpoint.metadata import check_complete
from megaframe.checkpoint.metadata import read as read_metadata


def lineage_meta(
    run_id: str,
    step: int,
    parent: Path | None,
    parent_id: str | None,
    root: str | Path,
    owner: str = "",
    run_dir: str = "",
) -> dict:
    """The "lineage" entry of a checkpoint written by `run_id` at `step`, continuing `parent` (whose
    lineage id is `parent_id`; None for checkpoints written before lineage existed). `owner`: the run's id
    over all its launches and `run_dir` its folder (runops/access/owner.py); recorded when known."""
    ref = None
    if parent is not None:
        parent = Path(parent).resolve()
        # inside root: a bare folder name, so the whole checkpoint dir can be moved or copied with its lineage
        ref = parent.name if parent.parent == Path(root).resolve() else str(parent)
    # run id and step: a rewritten step folder (another branch)
    # gets a new id, which ends parent_of's chain there
    out = {"id": f"{run_id}:{step}", "run_id": run_id, "parent": ref, "parent_id": parent_id if ref else None}
    if owner:
        out.update(owner=owner, run_dir=str(Path(run_dir).resolve()))
    return out


def _meta(path: Path) -> dict | None:
    try:
        return read_metadata(path)
    except (OSError, ValueError):  # json.JSONDecodeError is a ValueError
        return None


def parent_of(path: Path, meta: dict, root: str | Path) -> Path | None:
    """The checkpoint `path` was resumed from, if it is still the same checkpoint (same lineage id)."""
    lin = meta.get("lineage") or {}
    ref = lin.get("parent")
    if not ref:
        return None
    parent = Path(ref) if Path(ref).is_absolute() else Path(root) / ref
    pmeta = _meta(parent)
    if pmeta is None:
        return None
    if lin.get("parent_id") is not None and (pmeta.get("lineage") or {}).get("id") != lin["parent_id"]:
        return None  # that step folder was rewritten by another branch: not our ancestor any more
    return parent


def chain(start: Path, root: str | Path, limit: int = 100_000) -> list[Path]:
    """`start` and its ancestors, newest first (a cycle or a missing parent ends it)."""
    out, seen, path = [], set(), Path(start)
    while path is not None and len(out) < limit:
        key = str(path.resolve())
        meta = _meta(path)
        if key in seen or meta is None:
            break
        seen.add(key)
        out.append(path)
        path = parent_of(path, meta, root)
    return out


def pointed(root: str | Path) -> Path | None:
    """The committed checkpoint `${root}/latest` names, or None (no pointer, or it names nothing)."""
    try:
        # binary garbage: no step folder's name
        name = (Path(root) / "latest").read_text(errors="replace").strip()
    except OSError:
        return None
    path = Path(root) / name
    # a bare name only: a pointer naming ../elsewhere must not send resume or prune outside root
    return path if name and "/" not in name and (path / "metadata.json").is_file() else None


def cheap_check(path: Path) -> str | None:
    """Why `path` cannot be a resume point from its metadata and file sizes alone (no shard bytes read:
    the load checks every block it reads against its checksum), or None."""
    try:
        check_complete(path)
    except (OSError, ValueError, KeyError) as e:  # CheckpointError is a ValueError
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def prune(root: str | Path, keep_last: int, owner: str | None = None) -> list[Path]:
    """Delete the ancestors of the newest checkpoint (the one `latest` names) beyond the `keep_last`
    newest of its chain; returns what was deleted. Only folders directly inside `root` are deleted, the
    newest is always kept, and nothing off the chain is touched. keep_last=0 keeps everything. With `owner`
    (the saving run's id), an ancestor another run owns is kept: a run that continued another's checkpoint
    on purpose never deletes that run's history."""
    head = pointed(root)
    if keep_last <= 0 or head is None:
        return []
    root_r = Path(root).resolve()
    gone = []
    # max(1, ..): the head itself is never deleted, whatever keep_last says
    for old in chain(head, root)[max(1, keep_last) :]:
        # an ancestor outside root (an imported or copied checkpoint) belongs to someone else: never deleted
        theirs = ((_meta(old) or {}).get("lineage") or {}).get("owner")
        if (
            old.resolve().parent == root_r
            and old.name.startswith("step_")
            and (not owner or theirs in (None, owner))
        ):
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
    return gone


def describe(path: Path) -> str:
    """One line for logs: the checkpoint and where it came from."""
    return f"{path} {origin(path)}"


def origin(path: Path) -> str:
    """Where a checkpoint came from: `(run R, parent P)`."""
    lin = (_meta(path) or {}).get("lineage") or {}
    return f"(run {lin.get('run_id', '?')}, parent {lin.get('parent') or 'none'})"
