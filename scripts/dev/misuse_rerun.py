"""Red team 2, re-run on the current code: the note's reproductions (../shared/notes/redteam-2.md, its
section 1 and the quick commands of section 2) and new attempts of the same classes (shared folders,
lineage corruption, tool inputs, field ranges), each a real command with its expected outcome.

    python scripts/dev/misuse_rerun.py [--work DIR] [--only PREFIX] [--keep]

Prints one row per attempt (id, class, held/DEFECT, what was seen) and the counts; exits 1 when any
attempt shows a defect. Every attempt is also "clean": no Python traceback, and an exit 2 prints exactly
one `megaframe: error:` line (argparse's own usage error counts as one). Takes about 20-25 minutes on a
loaded 2-core box (it trains a few tiny runs); not part of `make test` (tests/e2e/test_lost_work_cli.py
holds the representative cases). The attempts are in scripts/dev/misuse_attempts.py.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.seq_length=32", "train.global_batch_size=8",
        "train.micro_batch_size=2", "optim.warmup_steps=2", "optim.lr=3e-3", "train.log_interval=1",
        "logging.wandb.mode=disabled"]


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


def environ(extra: dict) -> dict:
    e = dict(os.environ)
    e.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=str(ROOT))
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


def _start_bg(a: Attempt) -> subprocess.Popen | None:
    if a.bg is None:
        return None
    proc = subprocess.Popen(a.bg, cwd=ROOT, env=environ(a.env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while a.bg_wait and not Path(a.bg_wait).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    return proc


def verdict(a: Attempt, rc: int, out: str) -> str | None:
    """None when the attempt held, else what went wrong."""
    want = a.rc if isinstance(a.rc, tuple) else (a.rc,)
    if rc not in want:
        return f"exit {rc}, expected {'/'.join(map(str, want))}"
    if "Traceback (most recent call last)" in out:
        return "a traceback"
    errors = [ln for ln in out.splitlines() if ln.startswith("megaframe: error:") or ": error: " in ln[:80]]
    if rc == 2 and len({ln for ln in errors}) != 1:
        return f"{len(errors)} error lines, expected one"
    for s in a.has:
        if s not in out:
            return f"no {s!r} in the output"
    for s in a.lacks:
        if s in out:
            return f"{s!r} in the output"
    return a.check() if a.check is not None else None


def attempt(a: Attempt) -> tuple[bool, str]:
    if a.prep is not None:
        a.prep()
    bg = _start_bg(a)
    try:
        res = subprocess.run(a.cmd, cwd=a.cwd or ROOT, env=environ(a.env), capture_output=True, text=True,
                             errors="replace", timeout=a.timeout)
        rc, out = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, "timed out (a hang?)"
    finally:
        if bg is not None:
            bg.terminate()
            try:
                bg.wait(timeout=60)
            except subprocess.TimeoutExpired:
                bg.kill()
                bg.wait()
    why = verdict(a, rc, out) if rc != -1 else out
    errs = [ln for ln in out.splitlines() if "error" in ln.lower()]
    seen = errs[-1] if errs else (out.strip().splitlines() or [""])[-1]
    return why is None, why or seen


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", help="folder for the runs (default: a new temporary folder)")
    ap.add_argument("--only", default="", help="run the attempts whose id starts with this")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="redteam-rerun-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from scripts.dev.misuse_attempts import attempts

    t0 = time.time()
    rows = []
    for a in attempts(work):
        if not a.id.startswith(args.only):
            continue
        held, what = attempt(a)
        rows.append((a, held))
        print(f"{a.id:<8} {a.klass:<16} {'held' if held else 'DEFECT':<6} {what[:150]}", flush=True)
    bad = [a.id for a, held in rows if not held]
    print(f"\n{len(rows)} attempts, {len(rows) - len(bad)} held, {len(bad)} defect{'s' if len(bad) != 1 else ''}"
          f"{': ' + ', '.join(bad) if bad else ''} ({time.time() - t0:.0f} s; work folder {work})")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
