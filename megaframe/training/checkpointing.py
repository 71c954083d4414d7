"""The trainer's side of checkpoints: what a save records, when a save is refused, and what to say.

Each save records its lineage (this run's id and the checkpoint it continues: the resume point for the
first save, then this run's previous save), the exact consumed samples, and runs under the watchdog's
save limit (a slow save is not a hang). A save is refused, keeping every committed checkpoint and
`latest` as they are, while the state is not finite (save_guard).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megaframe.checkpoint import lineage, sharded
from megaframe.checkpoint.async_save import AsyncSaver
from megaframe.checkpoint.resume import Resumed
from megaframe.checkpoint.resume_checks import Accounting
from megaframe.config.schema import Config, plain
from megaframe.data.kinds import data_state, tokenizer_identity
from megaframe.data.order import ORDER
from megaframe.errors import TrainingError
from megaframe.parallel.mesh import Mesh
from megaframe.training.save_guard import state_is_finite


class Checkpointer:
    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        ids: tuple[str, str],
        resumed: Resumed,
        acct: Accounting,
        watchdog,
        injector=None,
        data=None,
    ):
        """`ids`: this launch's id and the run's
        (runops/access/owner.py; "" where no run folder was claimed)."""
        self.cfg, self.mesh, self.acct = cfg, mesh, acct
        self.run_id, self.owner = ids
        self.watchdog, self.injector = watchdog, injector
        self.order = getattr(data, "order", ORDER)  # recorded, so a resume keeps the sample order
        load = (resumed.meta or {}).get("io_load") or {}
        self.io = {f"ckpt/{k}": v for k, v in load.items() if k in ("read_bytes", "load_s")}
        """This rank's newest save/load figures, on every metrics row from then on."""
        parent_id = ((resumed.meta or {}).get("lineage") or {}).get("id")
        self.parent: tuple[Path | None, str | None] = (resumed.path, parent_id)
        self.saver = AsyncSaver(mesh) if cfg.checkpoint.async_save else None
        self.last_saved: str | None = None
        """The newest checkpoint this run wrote (committed, or being written in the background)."""
        self.clock = time.monotonic()
        """When this run started or last tried a save: checkpoint.interval_minutes counts from here."""

    def overdue(self) -> bool:
        """This rank's clock says a timed save is due (host only; the ranks agree on it at a check step)."""
        minutes = self.cfg.checkpoint.interval_minutes
        return minutes > 0 and time.monotonic() - self.clock >= 60 * minutes

    def save(self, model, optimizer, step: int, last: bool, bad_in_a_row: int) -> bool:
        """Checkpoint `step` (in the background unless `last`); False when refused as non-finite."""
        cfg, mesh = self.cfg, self.mesh
        self.clock = time.monotonic()  # also for a refused save: the next timed try waits a full interval
        with self.watchdog.suspended(cfg.checkpoint.save_timeout_s, lambda: self.overrun(step)):
            if self.saver is not None and last:
                self._settle(self.saver.wait)  # commit the older one first, so `latest` ends on this step
            # ZeRO's overlapped all-gather may still be writing the params (zero=3: gathers nothing, each rank
            # writes its own segments: the save never holds more than the step's gathered params)
            optimizer.settle()
            # the finiteness vote is collective: every rank reaches it, also after a skipped step
            finite = state_is_finite(model, optimizer, mesh)
            # both are the same on every rank (the skip follows the all-reduced grad norm, the vote is
            # collective), so all ranks return here together
            if bad_in_a_row or not finite:
                if mesh.rank == 0:
                    why = (
                        "the last step was skipped (non-finite grad norm)"
                        if bad_in_a_row
                        else "the weights or optimizer state hold NaN/inf"
                    )
                    print(
                        f"megaframe: warning: not saving step {step}: {why}; {self.resume_hint()}",
                        file=sys.stderr,
                        flush=True,
                    )
                return False
            if self.injector is not None:
                self.injector.save_delay(step)
            fail = self.injector.save_fault(step) if self.injector is not None else None
            try:
                self._write(model, optimizer, step, self.saver is not None and not last, fail)
            except sharded.SaveError as e:
                self._failed(e, step if last else None)
                return False
        return True

    def _failed(self, e: Exception, last_step: int | None = None) -> None:
        """A save that was not committed (every rank raised it together): stop with exit 1, or go on.
        `last_step`: it was the run's last save, of that step; no later save can try again, so it ends the
        run with exit 1 under either policy, naming the steps that are not saved."""
        self.last_saved = str(lineage.pointed(self.cfg.checkpoint.dir) or "") or None  # the summary's
        if self.cfg.checkpoint.on_save_error == "stop":
            raise TrainingError(f"{e} (checkpoint.on_save_error=stop)") from e
        if last_step is not None:
            raise TrainingError(f"{e}; it was the run's last save: {self.unsaved(last_step)}") from e
        if self.mesh.rank == 0:
            print(
                f"megaframe: warning: {e}; going on (checkpoint.on_save_error=continue)",
                file=sys.stderr,
                flush=True,
            )

    def unsaved(self, step: int) -> str:
        """Which steps up to `step` no committed checkpoint holds, and the one a restart resumes from."""
        path = lineage.pointed(self.cfg.checkpoint.dir)
        first = int(path.name.split("_")[-1]) + 1 if path is not None else 1
        steps = f"step {step}" if first >= step else f"steps {first}-{step}"
        kept = f"the last committed checkpoint is {path}" if path else "no checkpoint has been committed"
        return f"{steps} not saved; {kept} (checkpoint.on_save_error=continue)"

    def take_io(self) -> dict:
        """This rank's newest save and load figures
        (they stay on the rows until a newer save replaces them)."""
        return dict(self.io)

    def _write(self, model, optimizer, step: int, background: bool, fail: str | None) -> None:
        cfg, mesh, t0 = self.cfg, self.mesh, time.perf_counter()
        root = cfg.checkpoint.dir
        consumed = self.acct.consumed(step)
        t = cfg.train
        data = {
            **data_state(cfg.data, step, t.seed, t.global_batch_size, self.order),
            "consumed_samples": consumed,
        }
        meta = {
            "consumed_samples": consumed,
            # apart from samples: a RoPE resume may change their length (resume_checks.resume_position)
            "consumed_tokens": self.acct.consumed_tokens(step),
            "layout": {
                "tp": mesh.tp.size,
                "cp": mesh.cp.size,
                "pp": mesh.pp.size,
                "dp": mesh.dp.size,
                "ep": mesh.ep.size,
                "etp": mesh.etp.size,
                "sp": cfg.parallel.sp,
            },
            "rng": "derived from (train.seed, step, pp and dp rank); no state to restore",
            "data": data,
            "config": plain(cfg),
            "tokenizer": tokenizer_identity(cfg.data),  # a resume checks its data against it
            "lineage": lineage.lineage_meta(self.run_id, step, *self.parent, root, self.owner, cfg.run.dir),
        }
        if background:
            self.saver.save(root, step, model, optimizer, meta, cfg.checkpoint.keep_last, fail)
            if mesh.rank == 0:
                print(
                    f"checkpoint: step {step} copied to host in {time.perf_counter() - t0:.2f}s, writing",
                    flush=True,
                )
        else:
            path = sharded.save(
                root, step, model, optimizer, mesh, meta, cfg.checkpoint.keep_last, fail, self.io
            )
            # the rank that prints the run summary: under torchrun this line comes before it
            if mesh.is_logger:
                print(f"checkpoint: {path} ({time.perf_counter() - t0:.2f}s)", flush=True)
        # set even for a save still writing in the background:
        # the next save's lineage follows the order of saves
        self.parent = (sharded.step_dir(root, step), meta["lineage"]["id"])
        self.last_saved = str(self.parent[0])

    def writing(self) -> bool:
        """Whether this rank's background write is still running (host state; no collective)."""
        return self.saver is not None and self.saver.writing()

    def poll(self, all_written: bool) -> None:
        """Commit a finished background save once the ranks agreed none is `writing()` (every rank passes
        the same value). Not suspended: a metadata write, and a rank waiting there for a hung peer must
        still trip at train.hang_timeout_s."""
        if self.saver is not None:
            self._settle(lambda: self.saver.poll(all_written))

    def finish(self, step: int) -> None:
        """The background save still writing (the run stopped at a step saved in the background) committed:
        the run's last save, so its failure ends the run (`step`: the run's last step)."""
        if self.saver is not None:
            with self.watchdog.suspended(
                self.cfg.checkpoint.save_timeout_s, lambda: self.overrun(self.last_saved)
            ):
                self._settle(self.saver.wait, step)

    def _settle(self, finish, last_step: int | None = None) -> None:
        """Run the background save's commit step; its figures join io, a failed commit goes to _failed."""
        try:
            finish()
        except sharded.SaveError as e:
            self._failed(e, last_step)
        self.io.update(self.saver.last_io)
        self.saver.last_io = {}

    def overrun(self, what: int | str | None) -> str:
        """The line a save (of step `what`, or into folder `what`) past checkpoint.save_timeout_s ends the
        run with (watchdog, exit 1)."""
        path = lineage.pointed(self.cfg.checkpoint.dir)
        kept = (
            f"the last committed checkpoint, {path}, is intact"
            if path
            else "no checkpoint has been committed"
        )
        name = f"step {what}" if isinstance(what, int) else str(what)
        return (
            f"checkpoint {name} not committed: the save took longer than checkpoint.save_timeout_s="
            f"{self.cfg.checkpoint.save_timeout_s:g}s; {kept}"
        )

    def resume_hint(self) -> str:
        """Which committed checkpoint to resume from (the one `latest` names), for the stop message."""
        path = lineage.pointed(self.cfg.checkpoint.dir)
        if path is None:
            return "no checkpoint has been committed: restart from scratch (e.g. with a lower optim.lr)"
        return (
            f"the last good checkpoint is {path}: resume with "
            f"checkpoint.resume={path} (e.g. with a lower optim.lr)"
        )
