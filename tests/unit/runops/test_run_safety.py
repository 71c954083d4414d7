"""Lineage (what resume=auto follows and keep_last may delete), the run-dir lock, checkpoint file modes,
the watchdog's save limit, and the token-id range check: one process, real files."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megaframe.checkpoint import lineage, resolve, sharded


def fake_ckpt(root, step, run_id, parent=None, parent_id=None):
    """A committed step folder with lineage metadata (no tensors: lineage reads metadata only)."""
    d = sharded.step_dir(root, step)
    d.mkdir(parents=True)
    lin = lineage.lineage_meta(run_id, step, parent, parent_id, root)
    (d / "metadata.json").write_text(
        json.dumps({"format": sharded.FORMAT, "step": step, "files": {}, "tensors": {}, "lineage": lin})
    )
    (root / "latest").write_text(d.name + "\n")
    return d, lin["id"]


def test_rollback_keeps_the_new_branch_and_auto_follows_it(tmp_path):
    """Run A saves 2,4,6,8; a rollback B resumes from 4 and saves 5 and 6 (overwriting A's 6):
    the chain from `latest` is B6 -> B5 -> A4 -> A2; A8 is off the chain and never deleted."""
    ids = {}
    parent = (None, None)
    for s in (2, 4, 6, 8):
        d, ids[s] = fake_ckpt(tmp_path, s, "A", *parent)
        parent = (d, ids[s])
    parent = (sharded.step_dir(tmp_path, 4), ids[4])
    import shutil

    shutil.rmtree(sharded.step_dir(tmp_path, 6))  # B rewrites step 6
    for s in (5, 6):
        d, i = fake_ckpt(tmp_path, s, "B", *parent)
        parent = (d, i)
    names = [p.name for p in resolve.resume_order(tmp_path)]
    # A8 is another branch: never a resume candidate, not even as a last resort
    assert names == ["step_00000006", "step_00000005", "step_00000004", "step_00000002"]
    gone = lineage.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in gone) == ["step_00000002", "step_00000004"]
    left = sorted(p.name for p in sharded.committed(tmp_path))
    assert left == ["step_00000005", "step_00000006", "step_00000008"]


def test_a_rewritten_parent_folder_ends_the_chain(tmp_path):
    d2, i2 = fake_ckpt(tmp_path, 2, "A")
    d3, _ = fake_ckpt(tmp_path, 3, "A", d2, i2)
    import shutil

    shutil.rmtree(d2)
    fake_ckpt(tmp_path, 2, "C")  # another branch took the name step_00000002
    (tmp_path / "latest").write_text(d3.name)
    assert [p.name for p in lineage.chain(d3, tmp_path)] == ["step_00000003"]
    assert lineage.prune(tmp_path, keep_last=1) == []  # C's checkpoint is not ours to delete


def test_cheap_check_reads_sizes_not_bytes(tmp_path):
    d = tmp_path / "step_00000001"
    d.mkdir()
    (d / "shard_00000.safetensors").write_bytes(b"x" * 10)
    (d / "metadata.json").write_text(
        json.dumps(
            {
                "format": sharded.FORMAT,
                "step": 1,
                "tensors": {},
                "coverage": "exact",
                "files": {"shard_00000.safetensors": {"bytes": 10, "crc32": 1}},
            }
        )
    )
    assert lineage.cheap_check(d) is None  # a wrong crc is the load's business, not this check's
    (d / "shard_00000.safetensors").write_bytes(b"x" * 9)
    assert "9 bytes" in lineage.cheap_check(d)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoint_shards_follow_the_umask(tmp_path, umask, mode, monkeypatch):
    from megaframe.checkpoint import store

    monkeypatch.setattr(store, "_UMASK", umask)  # the process umask is read once at import
    store.write_file(tmp_path, 0, {"w": torch.zeros(3)})
    assert (tmp_path / store.shard_name(0)).stat().st_mode & 0o777 == mode


def test_default_umask_gives_0644_shards(tmp_path):
    code = (
        "import os, torch; os.umask(0o022); from megaframe.checkpoint import store; "
        f"store.write_file(__import__('pathlib').Path({str(tmp_path)!r}), 0, {{'w': torch.zeros(2)}}); "
        f"print(oct(os.stat(os.path.join({str(tmp_path)!r}, store.shard_name(0))).st_mode & 0o777))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.stdout.strip() == "0o644", out.stderr


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, monkeypatch):
    from megaframe.runops.access.runlock import LOCK_NAME, RunDirBusy, RunLock

    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": holder.pid,
                    "job": "SLURM_JOB_ID=7",
                    "since": time.time(),
                }
            )
        )
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}, SLURM_JOB_ID=7"):
            RunLock(tmp_path).acquire()
        monkeypatch.setenv("SLURM_JOB_ID", "7")  # the same job id, but its holder here is alive
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.delenv("SLURM_JOB_ID")
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": holder.pid, "job": ""})
    )
    lock = RunLock(tmp_path).acquire()  # the holder is dead: stale, taken over
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "another-host", "pid": 1, "job": ""}))
    with pytest.raises(RunDirBusy, match="host another-host"):
        RunLock(tmp_path).acquire()


def test_watchdog_judges_a_save_by_the_save_limit(tmp_path):
    from megaframe.parallel.mesh import CommStats
    from megaframe.runops.watchdog import Watchdog

    tripped = []
    wd = Watchdog(0.5, 0, str(tmp_path), CommStats(), exit_fn=tripped.append, grace_s=0).start()
    try:
        with wd.suspended(0):  # a 1.5 s save, three times the step limit, no save limit
            time.sleep(1.5)
        assert tripped == []
        with wd.suspended(0.5):
            time.sleep(1.5)
        assert tripped == [124]
    finally:
        wd.stop()


def test_token_ids_outside_the_vocabulary_name_shard_and_offset(tmp_path):
    from megaframe.data.dataset import PreparedData
    from megaframe.data.shards import CorruptShard

    ids = np.arange(200, dtype="<u2") % 50
    ids[137] = 60000
    (tmp_path / "shard_00000_00000.bin").write_bytes(ids.tobytes())
    (tmp_path / "meta.json").write_text(
        json.dumps(
            {
                "vocab_size": 64,
                "dtype": "uint16",
                "shards": [{"file": "shard_00000_00000.bin", "num_tokens": 200}],
            }
        )
    )
    data = PreparedData(tmp_path, seq_length=16)
    data[0]  # clean sample
    with pytest.raises(
        CorruptShard, match=r"shard_00000_00000.bin is corrupt: token id 60000 at token offset 137"
    ):
        data[8]  # tokens 128..144


def test_a_head_without_metadata_is_named_so(tmp_path):
    """`latest` naming a step folder whose metadata.json is gone: the warning says so, not that it is no
    step folder."""
    from megaframe.checkpoint import resolve

    d2, i2 = fake_ckpt(tmp_path, 2, "A")
    d4, _ = fake_ckpt(tmp_path, 4, "A", d2, i2)
    (d4 / "metadata.json").unlink()
    said = []
    assert resolve.head(tmp_path, warn=said.append) == d2
    assert "names 'step_00000004', whose metadata.json is missing" in said[0], said


@pytest.mark.parametrize("text", ["{}", '{"pid": "123"}', '{"host": "h"}', '{"host": 5, "pid": 7}'])
def test_a_lock_naming_no_owner_is_taken_over_once_old(tmp_path, text, capsys):
    """Valid JSON without an identity (no host, no whole pid) was never stale: `in use by another run
    (host None, pid None, since 1970...)` forever. Now it is an unreadable lock: busy while fresh (a
    taker may be writing it), with the way out named, and taken over once a minute old."""
    import os
    import time

    from megaframe.runops.access.runlock import LOCK_NAME, RunDirBusy, RunLock

    lock = tmp_path / LOCK_NAME
    lock.write_text(text)
    with pytest.raises(RunDirBusy, match="names no owner.*remove it"):
        RunLock(tmp_path).acquire()
    old = time.time() - 120
    os.utime(lock, (old, old))
    got = RunLock(tmp_path).acquire()
    assert got.held and "taking over the lock" in capsys.readouterr().out
    got.release()
