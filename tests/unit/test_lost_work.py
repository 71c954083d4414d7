"""Issue 26 (red team 2, newcomer 2 F6): nothing a run writes lands outside its folders or in another
job's; each test is a reproduction of the note (S1, L1, L2, T2, ...) that failed on the code before."""
import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.training.folders import claim
from megaframe.training.runlock import LOCK_NAME, RunDirBusy, RunLock


def dirs(run_dir, ckpt_dir):
    return SimpleNamespace(run=SimpleNamespace(dir=str(run_dir)), checkpoint=SimpleNamespace(dir=str(ckpt_dir)))


@pytest.fixture
def no_job(monkeypatch):
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


# --- folders: S1, T2, L1 ---
@pytest.mark.parametrize("override,key", [("run.dir=", "run.dir"), ("checkpoint.dir=", "checkpoint.dir"),
                                          ("run.dir=/", "run.dir")])
def test_an_empty_run_dir_is_refused_not_slash_checkpoints(override, key):
    """S1: run.dir=$RUN_DIR with RUN_DIR unset wrote to /checkpoints."""
    with pytest.raises(ConfigError, match=f"^{key}="):
        load_config(["data=synthetic", override], world_size=1)


def test_an_uncreatable_checkpoint_dir_is_refused_at_start(tmp_path, no_job):
    """T2: found at the first save, hours in, as a FileNotFoundError traceback."""
    with pytest.raises(ConfigError, match=r"^checkpoint.dir=/proc/megaframe-no/ck: cannot write there"):
        claim(dirs(tmp_path / "run", "/proc/megaframe-no/ck"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        load_config(["data=synthetic", f"checkpoint.dir={tmp_path / 'afile' / 'ck'}"], world_size=1)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # the run.dir lock taken first is given back


def test_two_runs_sharing_a_checkpoint_dir_the_second_is_refused(tmp_path, no_job):
    """L1: jobs with their own run.dir and one checkpoint.dir both exited 0, one replacing the other's checkpoints."""
    shared = tmp_path / "shared_ck"
    first = claim(dirs(tmp_path / "a", shared))
    try:
        with pytest.raises(ConfigError, match=f"^checkpoint.dir={shared} is in use by another run"):
            claim(dirs(tmp_path / "b", shared))
        assert not (tmp_path / "b" / LOCK_NAME).exists()
    finally:
        first.release()
    claim(dirs(tmp_path / "b", shared)).release()  # free again once the first run ended
    assert not (shared / LOCK_NAME).exists()


# --- lock takeover only from a holder proven gone: L2 and the stale lock on another host ---
def _lock(path, **holder):
    (path / LOCK_NAME).write_text(json.dumps({"since": time.time(), **holder}))


def test_the_same_slurm_job_never_takes_a_live_holders_lock(tmp_path, monkeypatch, no_job):
    """L2: two srun steps of one allocation share SLURM_JOB_ID; the second took over the live first's lock."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(tmp_path, host=socket.gethostname(), pid=holder.pid, job="SLURM_JOB_ID=778", restart=0)
        monkeypatch.setenv("SLURM_JOB_ID", "778")
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}, SLURM_JOB_ID=778"):
            RunLock(tmp_path).acquire()
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # even a "requeued" job: the pid here is alive
        with pytest.raises(RunDirBusy):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).acquire().release()  # dead now: taken over


def test_an_earlier_run_of_the_same_job_on_another_host_is_taken_over(tmp_path, monkeypatch, no_job):
    _lock(tmp_path, host="old-node", pid=1, job="SLURM_JOB_ID=5", restart=0)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    with pytest.raises(RunDirBusy):  # the same incarnation on another node: may be alive
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue: the old node's workers are gone
    RunLock(tmp_path).acquire().release()


@pytest.fixture
def fake_squeue(tmp_path, monkeypatch):
    """A `squeue` on PATH answering like Slurm's for job 99 (state in $FAKE_SQUEUE; 'invalid' = purged)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text('#!/bin/sh\nif [ "$FAKE_SQUEUE" = invalid ]; then\n'
                                 '  echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi\n'
                                 'echo "$FAKE_SQUEUE"\n')
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    return monkeypatch


@pytest.mark.parametrize("state,taken", [("COMPLETED", True), ("CANCELLED+", True), ("invalid", True),
                                         ("RUNNING", False), ("PENDING", False), ("", False)])
def test_a_stale_lock_on_another_host_is_taken_over_when_slurm_reports_its_job_gone(
        tmp_path, fake_squeue, no_job, state, taken, capsys):
    """Open item: a stale lock of a job on another host had to be removed by hand."""
    fake_squeue.setenv("FAKE_SQUEUE", state)
    (tmp_path / "run").mkdir()
    _lock(tmp_path / "run", host="node-17", pid=4242, job="SLURM_JOB_ID=99")
    if taken:
        RunLock(tmp_path / "run").acquire().release()
        assert "warning: taking over the lock" in capsys.readouterr().out
    else:
        with pytest.raises(RunDirBusy, match="host node-17"):
            RunLock(tmp_path / "run").acquire()
