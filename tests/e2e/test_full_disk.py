"""A full disk mid-run, on real size-limited file systems (a tmpfs mount, RLIMIT_FSIZE): a save that does
not fit is the documented one line `checkpoint step N not committed: ...` with its temporary folder removed,
and checkpoint.on_save_error=continue goes on while a later save can try again (the last save's failure
ends the run with exit 1, naming the steps not saved); a full run.dir (metrics) costs a warning, never the
run."""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from megaframe.checkpoint import sharded
from tests.e2e.helpers import ROOT, TINY, env

pytestmark = pytest.mark.e2e

# TINY's checkpoint is one ~7 MB shard (the vocabulary's rows): it never fits in 4 MiB, the metrics always do
OVER = [
    "data=synthetic",
    *TINY,
    "train.max_steps=3",
    "train.log_interval=1",
    "checkpoint.interval=1",
    "checkpoint.resume=none",
]


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    where.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({got.stderr.strip() or got.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def train(over: list[str], fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit():  # in the child only: the test process keeps its own limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "train.py", *over],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit if fsize else None,
    )


def assert_one_line_not_committed(res, ck: Path, step: int) -> None:
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"checkpoint step {step} not committed" in res.stderr, res.stderr[-3000:]
    assert not list(ck.glob("*.tmp")), list(ck.iterdir())


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_save_on_a_full_tmpfs_is_one_line_and_continue_goes_on(tmp_path, policy):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        ck = mnt / "ck"
        res = train(
            OVER
            + [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={ck}", f"checkpoint.on_save_error={policy}"]
        )
        assert_one_line_not_committed(res, ck, 1)
        assert "No space left on device" in res.stderr, res.stderr[-3000:]
        assert sharded.committed(ck) == [] and not (ck / "latest").exists()
        assert res.returncode == 1, res.stderr[-3000:]
        if policy == "continue":  # every save failed and training went on: the last failure is the run's end
            # (step 3 trained; a failed save ends the run before that step's row and evaluation)
            assert "step      2/3" in res.stdout, res.stdout[-2000:]
            assert res.stderr.count("going on (checkpoint.on_save_error=continue)") == 2, res.stderr[-3000:]
            last = res.stderr.strip().splitlines()[-1]
            assert last.startswith("megaframe: error: checkpoint step 3 not committed"), last
            assert "steps 1-3 not saved; no checkpoint has been committed" in last, last
            assert "run summary" not in res.stdout


def test_a_save_past_the_file_size_limit_is_one_line(tmp_path):
    ck = tmp_path / "ck"
    res = train(OVER + [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={ck}"], fsize=4 << 20)
    assert res.returncode == 1, res.stderr[-3000:]
    assert_one_line_not_committed(res, ck, 1)
    assert "File too large" in res.stderr, res.stderr[-3000:]


def test_a_full_run_dir_warns_once_and_the_run_trains_and_saves(tmp_path):
    with tmpfs(tmp_path / "mnt", "64k") as mnt:
        # six 4-KiB pages left: the lock, the run id and config.yaml (two pages) fit at start-up, and
        # metrics.jsonl's first two pages; a row is ~1.8 KB (the goodput and clock figures), so its ~5th row
        # needs another page, in the middle of the run
        (mnt / "filler").write_bytes(b"\0" * (40 << 10))
        ck = tmp_path / "ck"
        res = train(
            OVER
            + [
                f"run.dir={mnt / 'run'}",
                f"checkpoint.dir={ck}",
                "checkpoint.interval=0",
                "train.max_steps=20",
            ]
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        assert res.stderr.count("metrics.jsonl") <= 1, res.stderr[-3000:]
        assert "No space left on device" in res.stderr, res.stderr[-3000:]
        assert "step     20/20" in res.stdout, res.stdout[-2000:]
        assert [p.name for p in sharded.committed(ck)] == ["step_00000020"]
        assert 0 < len((mnt / "run" / "metrics.jsonl").read_text().splitlines()) < 20
