"""Logging through train.py: a stop signal sent to every process of the run (what `scancel` does, wandb's
service included) ends with the stop line and no wandb traceback; TensorBoard's events equal metrics.jsonl
across a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, TINY, env, train
from tests.unit.test_tracking import _assert_same, _events, _jsonl_scalars

pytestmark = pytest.mark.e2e

SYN = ["data=synthetic", *TINY, "train.log_interval=1"]


def _children(pid: int) -> list[int]:
    """The processes `pid` started (wandb-core runs in a session of its own: a process-group signal
    misses it, Slurm's does not)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while listed
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_to_every_process_with_wandb_offline_ends_without_a_traceback(tmp_path):
    args = [*SYN, "train.max_steps=100000", "logging.wandb.mode=offline", f"run.dir={tmp_path}"]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env(WANDB_MODE="offline"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while _rows(tmp_path / "metrics.jsonl") < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        kids = _children(proc.pid)
        assert kids, "wandb's service did not start"
        for pid in (proc.pid, *kids):
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "after SIGTERM; checkpoint saved" in err, err[-3000:]
    assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]


def test_tensorboard_events_equal_metrics_jsonl_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    # docs/after-training.md's commands: the second start resumes from the first's step-2 checkpoint
    over = [*SYN, "logging.wandb.mode=disabled", "logging.tensorboard.enabled=true", f"run.dir={tmp_path}"]
    for steps in (2, 3):
        r = train([*over, f"train.max_steps={steps}", "optim.warmup_steps=1"])
        assert r.returncode == 0, r.stderr[-3000:]
    events = _events(tmp_path / "tensorboard")
    _assert_same(events, _jsonl_scalars(tmp_path / "metrics.jsonl"))
    assert [s for s, _ in events["loss"]] == [1, 2, 3] and events["resumed_step"] == [(3, 2.0)]
