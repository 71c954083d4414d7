"""Asynchronous checkpoints: copy to host, write in a background thread, commit later.

At save time each rank copies the slices it owns to host memory (the only pause training sees) and
gathers the metadata entries; a thread then writes and fsyncs its shard and a small sidecar with the
file's size and checksum. At the trainer's check steps the ranks agree whether every writer is done
(a flag riding on the stop-signal all-reduce on the host: no collective or device sync of its own);
then rank 0 writes metadata.json and commits by rename, exactly as a synchronous save does. Host
memory is bounded: at most one checkpoint is in flight, and a new save first finishes the previous one.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megaframe.checkpoint import sharded
from megaframe.parallel.mesh import Mesh


@dataclass
class _Pending:
    root: Path
    tmp: Path
    final: Path
    step: int
    meta: dict
    entries: list
    keep_last: int
    thread: threading.Thread


class AsyncSaver:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.pending: _Pending | None = None
        self.error: BaseException | None = None

    def save(self, root, step: int, model, optimizer, meta: dict, keep_last: int) -> None:
        self.wait()
        mesh = self.mesh
        tmp, final = sharded.begin(root, step, mesh)
        tensors, entries = sharded.host_snapshot(model, optimizer, mesh, copy=True)
        gathered = [entries]
        if mesh.group is not None:
            gathered = [None] * mesh.world
            dist.all_gather_object(gathered, entries, group=mesh.group)
        thread = threading.Thread(target=self._write, args=(tmp, tensors), daemon=True)
        thread.start()
        self.pending = _Pending(Path(root), tmp, final, step, meta, gathered, keep_last, thread)

    def _write(self, tmp: Path, tensors: dict) -> None:
        try:
            written = sharded.write_file(tmp, self.mesh.rank, tensors)
            (tmp / f"shard_{self.mesh.rank:05d}.json").write_text(json.dumps(written))
        except BaseException as e:  # surfaced on the main thread at commit
            self.error = e

    def writing(self) -> bool:
        """Whether this rank's writer thread is still running (host state; no collective)."""
        return self.pending is not None and self.pending.thread.is_alive()

    def poll(self, all_written: bool) -> None:
        """Commit the pending checkpoint if `all_written`: the ranks' agreement that none is `writing()`
        (every rank must pass the same value; rank 0 then reads every rank's sidecar)."""
        if self.pending is not None and all_written:
            self._commit()

    def wait(self) -> None:
        """Finish and commit the pending checkpoint; collective."""
        if self.pending is not None:
            self.pending.thread.join()
            sharded._barrier(self.mesh)
            self._commit()

    def _commit(self) -> None:
        p, self.pending = self.pending, None
        if self.error is not None:
            raise RuntimeError(f"async checkpoint write failed: {self.error}") from self.error
        if self.mesh.rank == 0:
            parts = []
            for r, entries in enumerate(p.entries):
                side = p.tmp / f"shard_{r:05d}.json"
                written = json.loads(side.read_text()) if side.is_file() else None
                side.unlink(missing_ok=True)
                parts.append({"entries": entries, "file": tuple(written) if written else None})
            sharded.commit(p.root, p.tmp, p.final, p.step, p.meta, parts)
            sharded.prune(p.root, p.keep_last)
            print(f"checkpoint: {p.final} (written in the background)", flush=True)
