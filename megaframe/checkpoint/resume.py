"""Where a run starts: the checkpoint `checkpoint.resume` names, loaded only if its config fits.

resume=auto walks `resolve.resume_order` (the `latest` pointer, then its ancestors; never another branch): a
candidate whose metadata or file sizes are wrong is skipped on rank 0's cheap check, and one whose load fails
on ANY rank (a corrupt shard is caught by whoever reads it) is skipped by every rank: the ranks vote after
each load (one scalar all-reduce), so they always agree on the checkpoint they continue from. An explicit path
that fails to load is bad input (exit 2, one line).

Only the checkpoint's own faults (a missing, corrupt or mismatched file: LOAD_ERRORS) make a load "fail".
Running out of memory, an accelerator fault or a broken collective backend while loading says nothing about
the checkpoint: skipping to an older one would silently throw work away. Such an error stops the run on every
rank (TrainingError, exit 1, one line naming the phase and the checkpoint); nothing is skipped or pruned,
`latest` and every checkpoint stay as they are.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError  # a bad header or truncated file: not an OSError

from megaframe.checkpoint import lineage, resolve, sharded
from megaframe.checkpoint.load import not_the_checkpoints_fault
from megaframe.checkpoint.resume_checks import check_resume, consumed_samples
from megaframe.config.schema import Config, ConfigError
from megaframe.errors import TrainingError
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis, Mesh

# what a missing, corrupt or mismatched checkpoint raises on load; anything else is a bug and propagates.
# RuntimeError is here for torch's shape and dtype complaints about a mismatched file, but its out-of-memory,
# accelerator and collective subclasses are not the checkpoint's fault (not_the_checkpoints_fault): they stop
# the run instead
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
# the vote of each rank after a load: the MIN over ranks is the outcome
_STOPPED, _FAILED, _LOADED = -1.0, 0.0, 1.0


@dataclass
class Resumed:
    step: int = 0
    """The step the loaded checkpoint holds (0: a fresh start)."""
    path: Path | None = None
    consumed: int = 0
    """Samples consumed at that step (the data continues from here)."""
    meta: dict | None = None


def world_axis(mesh: Mesh) -> Axis:
    """The whole mesh as one axis, so a vote goes through comm like every collective."""
    return Axis("world", mesh.world, mesh.rank, tuple(range(mesh.world)), mesh.group, mesh.stats)


def _vote(mine: float, mesh: Mesh) -> float:
    """The MIN of every rank's vote; collective (one scalar all-reduce over the mesh)."""
    # a float MIN: every backend reduces floats; one lower vote from any rank decides
    flag = torch.tensor([mine], device=mesh.device)
    comm.all_reduce(flag, world_axis(mesh), op=dist.ReduceOp.MIN)
    return float(flag.item())  # the host needs the decision


def _agree(path: Path, meta: dict | None, stop: str | None, mesh: Mesh) -> bool:
    """Every rank's load outcome of `path`: True when all loaded, False when some rank hit a fault of the
    checkpoint; TrainingError on every rank when some rank was stopped by something else (out of
    memory...)."""
    verdict = _vote(_STOPPED if stop else _LOADED if meta is not None else _FAILED, mesh)
    if verdict == _STOPPED:
        # every rank names the first stopped rank's error (one extra collective, on this failure path only)
        first = next(s for s in comm.gather_objects(stop, mesh.group) if s)
        raise TrainingError(
            f"loading checkpoint {path} failed: {first}; not a fault of the checkpoint, so it was not "
            f"skipped (it, older checkpoints and `latest` are untouched): free memory or fix the "
            f"machine and rerun"
        )
    return verdict == _LOADED


def _warn(mesh: Mesh, msg: str, every_rank: bool = False) -> None:
    if every_rank or mesh.rank == 0:
        print(f"megaframe: warning: {msg}", file=sys.stderr, flush=True)


def _load(
    cfg: Config, path: Path, model, optimizer, mesh: Mesh, faults=None
) -> tuple[dict | None, str, str | None]:
    """Check the config against the checkpoint's, then load: (meta, "", None), (None, why the checkpoint
    cannot be loaded, None), or (None, "", what stopped the load) for an error that is not the checkpoint's
    fault."""
    try:
        meta = sharded.read_metadata(path)
    except LOAD_ERRORS as e:
        return None, _one(e), None
    check_resume(cfg, meta, path, verbose=mesh.rank == 0)  # a refused change is bad input, not a fallback
    try:
        if faults is not None:
            faults.load_fault(int(meta["step"]))  # MEGAFRAME_INJECT=loadoom: a drill of the branch below
        # reads this rank's plan, checks every block it reads
        meta = sharded.load_into(path, model, optimizer)
    except (*LOAD_ERRORS, MemoryError) as e:
        if not_the_checkpoints_fault(e):
            return None, "", f"rank {mesh.rank}: {_one(e)}"
        return None, _one(e), None
    return meta, "", None


def _one(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def resume(cfg: Config, model, optimizer, mesh: Mesh, faults=None) -> Resumed:
    """Load the checkpoint checkpoint.resume names (auto: along the lineage); Resumed() when fresh. `faults`:
    the run's injected faults (runops/faults.py), None in a real run."""
    r = cfg.checkpoint.resume
    if r == "none":
        return Resumed()
    if r != "auto":
        meta, why, stop = _load(cfg, Path(r), model, optimizer, mesh, faults)
        # every rank votes, also one whose load failed, so none waits alone in the all-reduce
        if not _agree(Path(r), meta, stop, mesh):
            raise ConfigError(f"checkpoint {r} cannot be loaded ({why or 'failed on another rank'})")
        return _done(mesh, Path(r), meta)
    # rank 0 decides the order (and the cheap checks), so every rank walks the same list
    order = _auto_order(cfg, mesh) if mesh.rank == 0 else None
    order = comm.broadcast_object(order, mesh)
    if isinstance(order, str):  # the lineage is unknown (checkpoint/resolve.py): every rank exits 2 alike
        raise ConfigError(f"checkpoint.resume=auto: {order}")
    tried = None
    for p in map(Path, order):
        meta, why, stop = _load(cfg, p, model, optimizer, mesh, faults)
        if why:
            _warn(
                mesh,
                f"skipping checkpoint {p}: cannot be loaded on rank {mesh.rank} ({why})",
                every_rank=True,
            )
        # loaded on some ranks but not on others: all move on together;
        # the next candidate's load overwrites what this one left
        if _agree(p, meta, stop, mesh):
            return _done(mesh, p, meta)
        tried = p
    if tried is not None:
        # a failed load may have overwritten part of the state on some ranks: a "fresh" start from here
        # would train on mixed, rank-dependent weights, so it is refused rather than silently begun
        raise ConfigError(
            f"checkpoint.resume=auto: no checkpoint under {cfg.checkpoint.dir} could be loaded "
            f"(last tried {tried}); move them away or set checkpoint.resume=none to start fresh"
        )
    return Resumed()


def _auto_order(cfg: Config, mesh: Mesh) -> list[str] | str:
    """Rank 0: the checkpoints resume=auto tries (checkpoint/resolve.py: `latest`'s branch only), those
    failing the cheap check left out; or why none can be picked."""
    try:
        found = resolve.resume_order(cfg.checkpoint.dir, warn=lambda m: _warn(mesh, m))
    except resolve.Unresolved as e:
        return str(e)
    order = []
    for p in found:
        why = lineage.cheap_check(p)  # metadata and file sizes only: the loads check the bytes
        if why:
            _warn(mesh, f"skipping checkpoint {p}: {why}")
        else:
            order.append(str(p))
    return order


def _done(mesh: Mesh, path: Path, meta: dict) -> Resumed:
    if mesh.rank == 0:
        print(f"resumed from {path} at step {meta['step']}", flush=True)
    return Resumed(int(meta["step"]), path, consumed_samples(meta), meta)
