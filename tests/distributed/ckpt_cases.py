"""Functions the rank pool runs for the checkpoint I/O tests: fn(mesh, *args)."""
from __future__ import annotations

from pathlib import Path

from megaframe.checkpoint import sharded
from megaframe.checkpoint.async_save import AsyncSaver
from tests.distributed.cases import full_state
from tests.distributed.zero_cases import _setup, _step


def train_and_save(mesh, overrides: list[str], folder: str, steps: int, fail_rank: int | None = None,
                   fail_step: int | None = None, use_async: bool = False, keep_last: int = 0) -> dict:
    """Steps 1..steps, saving after each; the save at fail_step fails on fail_rank. Returns this rank's
    figures of each save (or the SaveError text) and, on rank 0, the final full weights."""
    cfg, model, optimizer, data = _setup(mesh, overrides, steps)
    saver = AsyncSaver(mesh) if use_async else None
    out = {"saves": {}}
    for step in range(1, steps + 1):
        _step(mesh, cfg, model, optimizer, data, step)
        fail = "error" if (step == fail_step and mesh.rank == fail_rank) else None
        io: dict = {}
        try:
            if saver:
                saver.save(folder, step, model, optimizer, {"step_meta": step}, keep_last, fail)
                saver.wait()
                io = saver.last_io
            else:
                sharded.save(folder, step, model, optimizer, mesh, {"step_meta": step}, keep_last, fail, io)
            out["saves"][step] = io
        except sharded.SaveError as e:
            out["saves"][step] = str(e)
    out["weights"] = full_state(model, mesh)
    return out


def load_and_report(mesh, overrides: list[str], path: str) -> dict:
    """Load `path` into this layout; this rank's read figures, the files it opened, and (all ranks) the
    full weights."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 1)
    meta = sharded.load_into(Path(path), model, optimizer)
    return {**meta["io_load"], "weights": full_state(model, mesh)}


def load_agreed_report(mesh, overrides: list[str], path: str) -> str | None:
    """load_agreed (every rank learns whether all loaded): the agreed error, or None."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 1)
    return sharded.load_agreed(Path(path), model, optimizer, mesh)[1]
