"""Which run a checkpoint folder belongs to, so that no run silently continues, or writes over, another's.

A run's identity is the id in ${run.dir}/megaframe.run_id, written by its first start (rank 0, under the run
lock) and read by every later start in that run folder: a rerun of the same command, torchrun's restarts, a
Slurm requeue (same job id, same run dir), `make train RUN=...`, the folder moved or copied. run.name alone
cannot be it: without MEGAFRAME_RUN_NAME it is a new timestamp at every launch, also for `run.dir=runs/a`
typed twice. Every checkpoint records the id (metadata.json: lineage.owner, with lineage.run_dir to name it).

A checkpoint dir whose head (what `latest` names: checkpoint/resolve.py) records another owner belongs to
another run. This run writes there only when it continues one of that folder's checkpoints on purpose:
checkpoint.resume=<its step folder> or =<the checkpoint dir> (its `latest`). checkpoint.resume=auto is refused
there (it would train on another run's weights without a word), and so are resume=none and a resume from
elsewhere (they would add a branch beside the other run's checkpoints and move its `latest`): exit 2, naming
the folder, the other run and both ways out.
A checkpoint written before owners were recorded, or by import_hf, has no owner: anyone may continue it.
A run folder without an id whose own checkpoint dir (inside it) holds owned checkpoints takes their owner
when they all name one run: the id file was deleted, or the checkpoints were copied in on purpose; either
way they are this folder's. Checkpoints of several owners there (another run continued the folder on
purpose) name no owner for it: the run gets a new id and is refused as any other run would be.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megaframe.atomic import write_atomic
from megaframe.checkpoint import lineage, resolve
from megaframe.checkpoint.metadata import committed
from megaframe.config.schema import CheckpointConfig, RunConfig
from megaframe.errors import ConfigError

ID_NAME = "megaframe.run_id"


def read_id(run_dir: str | Path) -> str | None:
    """The run id recorded in `run_dir`, or None (a new run folder, or one older than run ids)."""
    try:
        text = (Path(run_dir) / ID_NAME).read_text(errors="replace").strip()
    except OSError:
        return None
    # a damaged file (binary, huge) is no identity: the folder's own checkpoints then tell it (settle)
    return text if text and text.isprintable() and len(text) <= 512 else None


def new_id(name: str) -> str:
    """Readable (the run name and when it started) and unique (a random suffix)."""
    return f"{name}@{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


def owner(path: Path | None) -> tuple[str | None, str]:
    """(owner id, run dir) a checkpoint records; (None, "?") when it records none."""
    lin = (lineage._meta(path) or {}).get("lineage") if path is not None else None
    if not isinstance(lin, dict):
        return None, "?"
    who = lin.get("owner")
    return (who if isinstance(who, str) and who else None), str(lin.get("run_dir") or "?")


def _heads(root: Path) -> list[Path]:
    """What this run would continue or move away from: the head, or every branch tip when `latest` is unusable
    over several branches (resume=auto then refuses the folder itself, naming them)."""
    try:
        found = resolve.head(root, warn=lambda msg: None)
    except resolve.Unresolved:
        return resolve.heads(root)
    return [found] if found is not None else []


def settle(run: RunConfig, ckpt: CheckpointConfig) -> str:
    """Rank 0, under the run lock: this run's id (read, adopted or new; written to run.dir), or ConfigError
    when checkpoint.dir belongs to another run and checkpoint.resume does not continue one of its
    checkpoints."""
    run_dir, root = Path(run.dir), Path(ckpt.dir)
    mine, heads = read_id(run_dir), _heads(root)
    if mine is None and heads and root.resolve().is_relative_to(run_dir.resolve()):
        mine = _sole_owner(root)  # the folder's own checkpoints: their run is this folder's
    mine = mine or new_id(run.name)
    foreign = next((h for h in heads if owner(h)[0] not in (None, mine)), None)
    if foreign is not None and not _continues(ckpt.resume, root):
        raise ConfigError(refusal(run, ckpt, foreign))
    if read_id(run_dir) != mine:
        try:
            write_atomic(run_dir / ID_NAME, mine + "\n")
        # rank 0 alone is here: an exception would leave the peers waiting in the broadcast
        except OSError as e:
            raise ConfigError(f"run.dir={run.dir}: cannot record the run id ({e.strerror or e})") from None
    return mine


def _sole_owner(root: Path) -> str | None:
    """The one run every owned checkpoint in `root` names, or None when there are none or several: after
    another run continued the folder on purpose, the newest head is that run's, and adopting it would let
    this folder's run train on the other's branch without a word (a fresh id is then refused as usual)."""
    owners = {owner(p)[0] for p in committed(root)} - {None}
    return owners.pop() if len(owners) == 1 else None


def _continues(resume: str, root: Path) -> bool:
    """checkpoint.resume names a checkpoint of `root`
    (load_config turned a checkpoint dir into its step folder)."""
    return resume not in ("auto", "none") and Path(resume).resolve().parent == root.resolve()


def refusal(run: RunConfig, ckpt: CheckpointConfig, head: Path) -> str:
    who, where = owner(head)
    root, r = ckpt.dir, ckpt.resume
    what = {
        "auto": "checkpoint.resume=auto continues only this run's own checkpoints",
        "none": "checkpoint.resume=none would start a second run beside them and move their `latest`",
    }.get(r, f"checkpoint.resume={r} is not one of its checkpoints: this run would move their `latest`")
    return (
        f"checkpoint.dir={root}: its newest checkpoint {head.name} belongs to another run ({who}, run.dir "
        f"{where}), not to this run.dir={run.dir}; {what}. To continue that run's checkpoint on purpose, "
        f"pass checkpoint.resume={head} (or checkpoint.resume={root}); to start anew, give this run its own "
        "checkpoint.dir"
    )
