"""Functions the rank pool runs for the checkpoint I/O tests: fn(mesh, *args)."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megaframe.checkpoint import sharded
from megaframe.checkpoint.async_save import AsyncSaver
from megaframe.checkpoint.layout import share_bytes
from megaframe.checkpoint.load import load_targets
from megaframe.checkpoint.metadata import check_complete
from tests.distributed.cases import full_state
from tests.distributed.zero_cases import _setup, _step


def train_and_save(
    mesh,
    overrides: list[str],
    folder: str,
    steps: int,
    fail_rank: int | None = None,
    fail_step: int | None = None,
    use_async: bool = False,
    keep_last: int = 0,
) -> dict:
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
    if (
        cfg.optim.zero == 3
    ):  # into gathered params (ZeRO-3 starts with all freed: the other path, zero3_freed_load_steps)
        optimizer.sync_params()
    meta = sharded.load_into(Path(path), model, optimizer)
    return {**meta["io_load"], "weights": full_state(model, mesh)}


def load_agreed_report(mesh, overrides: list[str], path: str) -> str | None:
    """load_agreed (every rank learns whether all loaded): the agreed error, or None."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 1)
    return sharded.load_agreed(Path(path), model, optimizer, mesh)[1]


class HostBytes(TorchDispatchMode):
    """The peak of host tensor storage alive that torch ops inside the mode created (each new storage counted
    once, from the op that made it until it is freed, views included). A dispatch mode rather than RSS: it
    sees exactly the tensors a load makes, whatever the allocator keeps or the pool's other tests left."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _freed(self, ptr: int, n: int) -> None:
        self._refs.pop(ptr, None)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if (
                n == 0 or ptr in inputs or ptr in self._refs
            ):  # a view, an in-place op's result, or counted already
                continue
            self.live += n
            self.peak = max(self.peak, self.live)
            self._refs[ptr] = weakref.ref(st, lambda _, ptr=ptr, n=n: self._freed(ptr, n))
        return out


def load_host_bytes(mesh, overrides: list[str], path: str, staging_bytes: int) -> dict:
    """Load `path` into this layout under HostBytes: the peak of host tensor bytes the load made, this rank's
    share (bytes of the ranges it holds) and of them the optimizer state the load creates (zero=0: its
    moments)."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 1)
    items, _, _ = load_targets(model, optimizer, check_complete(path))
    made = 0 if hasattr(optimizer, "state_segments") else 8 * sum(p.numel() for p in model.parameters())
    count = HostBytes()
    with count:
        meta = sharded.load_into(Path(path), model, optimizer, staging_bytes=staging_bytes)
    # what was loaded through the small buffer (pieces cut across its chunks) is the checkpoint, exactly (dp
    # only: local tensors are the global ones); ZeRO-3 starts with every param freed (meta start-up): gather
    # them to read
    if cfg.optim.zero == 3:
        optimizer.sync_params()
    wrong = []
    for name, p in model.named_parameters():
        for key, t in {
            f"model/{name}": p.detach(),
            **{f"optim/{k}/{name}": t for k, t in optimizer.logical_state(p).items()},
        }.items():
            key = (
                key if key in meta["tensors"] else f"model/{name}"
            )  # a master the checkpoint lacks: the weights'
            if not torch.equal(t.reshape(-1), sharded.load_full(path, key, meta).reshape(-1)):
                wrong.append(key)
    return {"peak": count.peak, "share": share_bytes(items), "made": made, "wrong": wrong}


def zero3_freed_load_steps(mesh, overrides: list[str], steps: int, load: str, start: int) -> dict:
    """ZeRO-3 with every block freed (as after a step, or a start-up that gathers nothing) loads `load` into
    its master segments, then runs steps start+1..steps: the losses and this rank's read figures."""
    cfg, model, optimizer, data = _setup(mesh, overrides, steps)
    for i in range(len(optimizer.units)):  # meta start-up frees them already; a gathered one is freed here
        optimizer._free(i)
    meta = sharded.load_into(Path(load), model, optimizer)
    losses = [_step(mesh, cfg, model, optimizer, data, s)[0] for s in range(start + 1, steps + 1)]
    return {"losses": losses, **meta["io_load"]}
