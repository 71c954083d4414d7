"""What the bad-input re-run (scripts/dev/misuse_rerun.py) and its attempt lists share: an attempt record,
the commands, the tiny model, and the trained set-up every attempt starts from. Imports no other script, so
the runner and the lists import it and not each other."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "train.log_interval=1",
    "logging.wandb.mode=disabled",
]


@dataclass
class Attempt:
    id: str
    klass: str
    cmd: list[str]
    rc: int | tuple[int, ...] = 2
    has: tuple[str, ...] = ()
    """Substrings the output (stdout + stderr) must hold."""
    lacks: tuple[str, ...] = ()
    prep: Callable[[], None] | None = None
    check: Callable[[], str | None] | None = None
    """After the command: None when the files are as expected, else what is wrong."""
    env: dict = field(default_factory=dict)
    bg: list[str] | None = None
    """A command started first (a live job holding folders), stopped after the attempt."""
    bg_wait: str = ""
    """A file the background job must have written before the attempt starts."""
    timeout: float = 240
    cwd: Path | None = None
    after: Callable[[], None] | None = None
    """Run whatever the attempt showed (a tmpfs unmounted, a background job's files read)."""


def environ(extra: dict) -> dict:
    e = dict(os.environ)
    e.update(
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(ROOT),
    )
    for var in ("MEGAFRAME_RUN_NAME", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MEGAFRAME_INJECT"):
        e.pop(var, None)
    e.update(extra)
    return e


def py(*args: str) -> list[str]:
    return [sys.executable, *args]


def sh(cmd: list[str], timeout: float = 600, **env) -> subprocess.CompletedProcess:
    """A set-up command that must succeed."""
    res = subprocess.run(cmd, cwd=ROOT, env=environ(env), capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"set-up failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return res


TRAIN = py(str(ROOT / "train.py"))
TORCHRUN2 = py("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "train.py"))
RACE = py(str(ROOT / "scripts" / "dev" / "misuse_race.py"))
GEN = py("-m", "megaframe.generate")
PLAN = py("-m", "megaframe.plan", "data=synthetic")
META_FORMS = {
    "list": "[]",
    "null": "null",
    "no-tensors": '{"format": "megaframe-ckpt-v2", "coverage": "exact"}',
    "files-list": '{"format": "megaframe-ckpt-v2", "coverage": "exact", "files": [], "tensors": {}}',
    "empty": "{}",
}


def cfg(*over: str, rc=(0, 2), has=(), synthetic=True) -> list:
    """A config-only attempt: train.py --cfg composes and
    validates (every check of a start) and trains nothing."""
    return [[*TRAIN, *(["data=synthetic"] if synthetic else []), *over, "--cfg"], rc, has]


class Setup:
    def __init__(self, work: Path):
        self.work = work
        self.data = ROOT / "data" / "demo" / "prepared"
        if not (self.data / "meta.json").is_file():
            sh(py("-m", "megaframe.data.prepare"), timeout=1800)
        self.rb = work / "rb"
        self.ck = self.rb / "checkpoints"
        if not (self.ck / "latest").is_file():
            common = [*TRAIN, *TINY, f"data.path={self.data}", f"run.dir={self.rb}"]
            sh(common + ["train.max_steps=8", "checkpoint.interval=2"])
            sh(
                common
                + [
                    "train.max_steps=6",
                    "checkpoint.interval=3",
                    f"checkpoint.resume={self.ck / 'step_00000002'}",
                ]
            )

    def p(self, name: str) -> Path:
        return self.work / name

    def copy(self, name: str, what: str = "ck") -> Path:
        """A fresh copy of the rollback's checkpoint dir (or its whole run folder: the same run)."""
        src = self.ck if what == "ck" else self.rb
        dst = self.p(name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("megaframe.lock"), symlinks=True)
        return dst if what == "ck" else dst / "checkpoints"

    def run_tiny(self, run_dir: str, *over: str) -> list[str]:
        return [*TRAIN, *TINY, f"data.path={self.data}", f"run.dir={self.p(run_dir)}", *over]

    def syn(self, run_dir: str, *over: str) -> list[str]:
        return [*TRAIN, *TINY, "data=synthetic", f"run.dir={self.p(run_dir)}", *over]


def write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def edit_meta(step: Path, fn) -> None:
    """Change a checkpoint's metadata.json in place (the lineage corruption attempts)."""
    meta = json.loads((step / "metadata.json").read_text())
    fn(meta)
    (step / "metadata.json").write_text(json.dumps(meta))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def stale_lock(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "megaframe.lock").write_text(
        json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "job": "", "since": time.time() - 60})
    )


def mount_tmpfs(where: Path, size: str, fill: int = 0) -> None:
    """A real size-limited file system (we are root); `fill` bytes of it taken by a filler file."""
    umount(where)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    if fill:
        (where / "filler").write_bytes(b"\0" * fill)


def umount(where: Path) -> None:
    if where.is_dir() and os.path.ismount(where):
        subprocess.run(["umount", "-l", str(where)], check=False)


def fsize_limited(cmd: list[str], kib: int) -> list[str]:
    """The command under `ulimit -f` (a file-size limit: writes past it fail with EFBIG)."""
    return ["bash", "-c", f'ulimit -f {kib}; exec "$@"', "fsize", *map(str, cmd)]
