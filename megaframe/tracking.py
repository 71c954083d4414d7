"""Where metrics go: ${run.dir}/metrics.jsonl, a console line, wandb and TensorBoard; all from one logging
rank."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from megaframe.config.schema import plain


def _fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Tracker:
    """Appends one JSON line per logged step, prints a readable line, mirrors to wandb and TensorBoard (each
    if enabled). `start_step`: the step the run resumed from (0: a fresh run)."""

    def __init__(self, cfg, run_dir: str, active: bool, max_steps: int, owner: str = "", start_step: int = 0):
        self.active, self.max_steps = active, max_steps
        self.schedule = cfg.optim.lr_schedule.value
        self.wandb_run = self.tb = None
        self.wandb_started = self.wandb_warned = False
        self.t_start = time.time()
        if not active:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        # append: a resumed run extends the same file;
        # line-buffered: every row reaches the file as it is logged
        self.file = open(self.path, "a", buffering=1)
        if cfg.logging.wandb.mode != "disabled":
            self.wandb_run = _start_wandb(cfg, run_dir, owner)
            self.wandb_started = self.wandb_run is not None
        if cfg.logging.tensorboard.enabled:
            self.tb = start_tensorboard(cfg.logging.tensorboard.dir, start_step)

    def log(self, metrics: dict, start_step: int) -> None:
        if not self.active:
            return
        self._append(json.dumps(metrics) + "\n")
        step = metrics["step"]
        # steps since this launch: a resumed run's earlier steps took no time here
        rate = (time.time() - self.t_start) / max(1, step - start_step)
        eta = rate * (self.max_steps - step)
        parts = [
            f"step {step:>6}/{self.max_steps}",
            f"loss {metrics['loss']:.4f}",
            f"lr {metrics['lr']:.2e} ({self.schedule})",
            f"grad {metrics['grad_norm']:.3f}",
            f"{metrics['tokens_per_s'] / 1e3:.1f}k tok/s",
        ]
        if "val_loss" in metrics:
            parts.insert(2, f"val {metrics['val_loss']:.4f}")
        if "aux_loss" in metrics:  # MoE: the router losses added to the objective
            parts.insert(2, f"aux {metrics['aux_loss']:.4f}")
        if "mtp_loss" in metrics:  # multi-token prediction's depths (model/mtp.py), beside the LM loss
            parts.insert(2, f"mtp {metrics['mtp_loss']:.4f}")
        if metrics.get("mfu"):
            parts.append(f"mfu {100 * metrics['mfu']:.1f}%")
        parts.append(f"eta {_fmt_duration(eta)}")
        print(" | ".join(parts), flush=True)
        if self.wandb_run is not None:  # explicit step: a resumed run continues the same history
            self._wandb(self.wandb_run.log, {k: v for k, v in metrics.items() if k != "step"}, step=step)
        if self.tb is not None:
            self.tb = self.tb.log(metrics)

    def _append(self, line: str) -> None:
        """metrics.jsonl is not worth a run: on a full disk (or any write error) one warning, then the console
        line and wandb go on without the file, and the checkpoints (checkpoint.dir) are still written."""
        if self.file is None:
            return
        try:
            self.file.write(line)
        except OSError as e:
            print(
                f"megaframe: warning: cannot write {self.path} "
                f"({e}); training goes on, metrics on the console "
                "and wandb only",
                file=sys.stderr,
                flush=True,
            )
            self._drop_file()

    def _drop_file(self) -> None:
        file, self.file = self.file, None
        with contextlib.suppress(OSError):  # close() flushes the line that did not fit again, and fails again
            file.close()

    def finish(self) -> None:
        if not self.active:
            return
        if self.file is not None:
            try:
                self.file.close()
            except OSError as e:
                print(f"megaframe: warning: cannot write {self.path} ({e})", file=sys.stderr, flush=True)
        if self.wandb_run is not None:
            self._wandb(self.wandb_run.finish)
        if self.tb is not None:
            self.tb.close()
        if self.wandb_started:
            _teardown_wandb(quiet=self.wandb_warned)

    def _wandb(self, fn, *args, **kwargs) -> None:
        """wandb never stops training: under Slurm a stop signal reaches every process of the step,
        wandb's service included, and a dead service makes log/finish raise. metrics.jsonl goes on."""
        import wandb

        try:
            fn(*args, **kwargs)
        # wandb's own errors, and the broken pipe / refused connection of a dead service (OSError)
        except (wandb.Error, OSError, RuntimeError) as e:
            print(
                f"megaframe: warning: wandb failed ({type(e).__name__}: {e}); logging to metrics.jsonl only",
                file=sys.stderr,
                flush=True,
            )
            self.wandb_run, self.wandb_warned = None, True


def tensorboard_problem(cfg) -> str | None:
    """One line naming the missing package when logging.tensorboard.enabled=true and tensorboard is not
    installed, else None. Checked before any process group (find_spec: nothing imported)."""
    import importlib.util

    if not cfg.logging.tensorboard.enabled or importlib.util.find_spec("tensorboard") is not None:
        return None
    return (
        "logging.tensorboard.enabled=true needs the tensorboard package, which is not installed: "
        "`pip install tensorboard` (a dependency of megaframe), or logging.tensorboard.enabled=false"
    )


def start_tensorboard(folder: str, start_step: int) -> TensorboardLog | None:
    """The event writer of `folder`; None (one warning, training goes on) when it cannot be opened.
    purge_step: a restart from the checkpoint of step S logs S+1.. again, and TensorBoard hides what an
    earlier start logged from S+1 on, so the curve is the one metrics.jsonl's last rows give."""
    try:
        from torch.utils.tensorboard import SummaryWriter

        return TensorboardLog(SummaryWriter(log_dir=folder, purge_step=start_step + 1), folder)
    except (ImportError, OSError) as e:
        _tb_warning(folder, e)
        return None


class TensorboardLog:
    """Every numeric value of a metrics row as a scalar of its own name, at the row's step and wall time
    (strings such as resumed_from, and None, are not scalars; `time` is the events' own wall time)."""

    def __init__(self, writer, folder: str):
        self.writer, self.folder = writer, folder

    def log(self, metrics: dict) -> TensorboardLog | None:
        """self, or None after a write error (one warning: the events are not worth a run)."""
        step, wall = metrics["step"], metrics.get("time")
        try:
            for key, value in metrics.items():
                if key not in ("step", "time") and _is_scalar(value):
                    self.writer.add_scalar(key, value, global_step=step, walltime=wall)
            # each row reaches the file as it is logged, like metrics.jsonl (a killed run loses none)
            self.writer.flush()
        except OSError as e:
            _tb_warning(self.folder, e)
            self.close()
            return None
        return self

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.writer.close()


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float))  # a flag (bool) too, as 0/1


def _tb_warning(folder: str, e: Exception) -> None:
    print(
        f"megaframe: warning: cannot write TensorBoard events to {folder} ({type(e).__name__}: {e}); "
        "training goes on, metrics in metrics.jsonl",
        file=sys.stderr,
        flush=True,
    )


def _teardown_wandb(quiet: bool) -> None:
    """Shut wandb's service down now, while a failure is ours to report: left to wandb's own atexit hook,
    a service already killed by the stop signal (`scancel` signals every process of the job) ends the log
    with an "Exception ignored in atexit callback ... ConnectionResetError" traceback after a clean stop.
    wandb.teardown() unregisters that hook before it talks to the service."""
    import wandb

    try:
        wandb.teardown()
    # the dead service's reset connection (OSError), and wandb's sys.exit with the exit code of a service
    # killed by a signal (SystemExit): neither may end the run or change its exit status
    except (wandb.Error, OSError, RuntimeError, SystemExit) as e:
        if not quiet:
            print(
                f"megaframe: warning: wandb did not shut down cleanly ({type(e).__name__}: {e})",
                file=sys.stderr,
                flush=True,
            )


def wandb_id(owner: str, name: str) -> str:
    """The wandb run id of a run folder: from its recorded identity (`owner`, ${run.dir}/megaframe.run_id,
    written at its first start: runops/access/owner.py), so every start in that folder, whatever launched
    it, continues one wandb run and another folder never joins it; the run name without one. Only the
    characters wandb accepts in an id, at most 64 (a long one keeps its start and a hash of the whole)."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "-", owner or name)
    if len(clean) <= 64:
        return clean
    return f"{clean[:55]}-{hashlib.sha256((owner or name).encode()).hexdigest()[:8]}"


def _start_wandb(cfg, run_dir: str, owner: str = ""):
    """Offline/online run with the run folder's id, so restarts continue the same run."""
    try:
        import wandb
    except ImportError:
        print("megaframe: warning: wandb not installed; logging to metrics.jsonl only", file=sys.stderr)
        return None
    os.environ.setdefault("WANDB_SILENT", "true")  # its banner would break up the step lines
    return wandb.init(
        project=cfg.logging.wandb.project,
        entity=cfg.logging.wandb.entity,
        mode=cfg.logging.wandb.mode,
        dir=run_dir,
        id=wandb_id(owner, cfg.run.name),
        # the name of the folder's first start: a later start with only run.dir given has a new default name
        name=owner.rpartition("@")[0] or cfg.run.name,
        resume="allow",
        config=plain(cfg),
    )


def wandb_login_problem(cfg) -> str | None:
    """One line naming the fix when logging.wandb.mode=online but wandb holds no credentials (no
    WANDB_API_KEY, no netrc entry for the server), else None. Checked before any process group: without
    it wandb.init fails at the first log rank after the model is built, with a 30-line traceback."""
    mode = os.environ.get("WANDB_MODE") or cfg.logging.wandb.mode  # wandb lets the environment win
    if mode != "online" or os.environ.get("WANDB_API_KEY"):
        return None
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        if read_netrc_auth(host=host):
            return None
    except ImportError:  # another wandb version: read the netrc ourselves
        import netrc
        from urllib.parse import urlparse

        try:
            if netrc.netrc(os.environ.get("NETRC")).authenticators(urlparse(host).hostname or host):
                return None
        except (OSError, netrc.NetrcParseError):
            pass
    return (
        f"logging.wandb.mode=online but wandb is not logged in to {host}: run `wandb login` "
        "(or set WANDB_API_KEY), or use logging.wandb.mode=offline"
    )
