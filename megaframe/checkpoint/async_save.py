"""Asynchronous checkpoints: copy to host, write in a background thread, commit on agreement later.

At save time each rank copies the tensors it writes to host memory (page-locked on CUDA; the only
pause training sees); a thread then writes and fsyncs its file and keeps its report (ok or the error,
size, header checksum, entries). At the trainer's check steps the ranks agree whether every writer is
done (a flag riding on the stop-signal all-reduce on the host: no collective or device sync of its own);
then they exchange reports and rank 0 commits exactly as a synchronous save does, only if every rank
succeeded and the coverage check passes. Otherwise nothing is committed and every rank raises SaveError.
Host memory is bounded: at most one checkpoint is in flight, and a new save first finishes the previous one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megaframe.checkpoint import sharded
from megaframe.parallel.mesh import Mesh


@dataclass
class _Pending:
    root: Path
    tmp: Path
    final: Path
    step: int
    meta: dict
    keep_last: int
    thread: threading.Thread
    t0: float
    report: dict | None = None


class AsyncSaver:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.pending: _Pending | None = None
        self.last_io: dict = {}
        # on CUDA, one page-locked buffer for every save's host copies (checkpoint/staging.py)
        self.staging = sharded.PinnedStaging() if mesh.device.type == "cuda" else None

    def save(
        self, root, step: int, model, optimizer, meta: dict, keep_last: int, fail: str | None = None
    ) -> None:
        # at most one save in flight: bounds host memory to
        # one copy of the state, and commits stay in step order
        self.wait()
        mesh = self.mesh
        t0 = time.perf_counter()
        tmp, final = sharded.begin(root, step, mesh)
        # copy=True: training goes on and updates the params in place while the thread writes
        stored = sharded.host_snapshot(model, optimizer, mesh, copy=True, pin=self.staging or False)
        pending = _Pending(Path(root), tmp, final, step, meta, keep_last, None, t0)  # type: ignore[arg-type]
        # daemon: a crashed trainer must not hang on the writer at
        # exit; its uncommitted .tmp is never taken for a checkpoint
        pending.thread = threading.Thread(target=self._write, args=(pending, stored, fail), daemon=True)
        pending.thread.start()
        self.pending = pending

    def _write(self, pending: _Pending, stored: list, fail: str | None) -> None:
        try:
            pending.report = sharded.write_report(pending.tmp, self.mesh.rank, stored, fail)
        except BaseException as e:  # anything else: still a report, so the ranks agree not to commit
            pending.report = {"rank": self.mesh.rank, "ok": False, "error": f"rank {self.mesh.rank}: {e!r}"}

    def writing(self) -> bool:
        """Whether this rank's writer thread is still running (host state; no collective)."""
        return self.pending is not None and self.pending.thread.is_alive()

    # never decided from this rank's writing() alone: ranks
    # that disagreed would not all enter finish()'s gathers
    def poll(self, all_written: bool) -> None:
        """Commit the pending checkpoint if `all_written`: the ranks' agreement that none is `writing()`
        (every rank must pass the same value; the report exchange below is then collective)."""
        if self.pending is not None and all_written:
            self._finish()

    def wait(self) -> None:
        """Finish and commit the pending checkpoint; collective."""
        if self.pending is not None:
            # join before the collective commit: this rank's report must exist before it is exchanged
            self.pending.thread.join()
            self._finish()

    def _finish(self) -> None:
        p, self.pending = self.pending, None
        report = {**p.report, "save_s": time.perf_counter() - p.t0}
        sharded.finish(p.root, p.tmp, p.final, p.step, p.meta, report, self.mesh, p.keep_last)
        self.last_io = {"ckpt/write_bytes": report["write_bytes"], "ckpt/save_s": report["save_s"]}
        if self.mesh.rank == 0:
            print(f"checkpoint: {p.final} (written in the background)", flush=True)
