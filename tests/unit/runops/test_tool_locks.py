"""The tools that write a folder take it the way a run does (megaframe.atomic_lock): import_hf into a
checkpoint dir a live run (or import) holds, and a second export_hf into one OUT, are refused with exit 2
naming the holder, before anything is written; once the holder is dead its lock is taken over."""

import json
import socket
import subprocess
import sys
import time

import pytest

from megaframe.runops.access.runlock import LOCK_NAME
from tests.unit.hf_scripts import script

export_hf, import_hf = script("export_hf"), script("import_hf")


@pytest.fixture
def holder():
    """A live process that a lock file names, as a running job would be."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def lock_of(path, pid):
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "job": "", "since": time.time()}))


def test_import_into_a_checkpoint_dir_held_by_a_live_run_is_refused(tmp_path, holder, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    lock_of(ck / LOCK_NAME, holder.pid)
    assert import_hf.main([str(tmp_path / "hf"), str(ck), "data=synthetic"]) == 2
    err = capsys.readouterr().err
    who = f"(host {socket.gethostname()}, pid {holder.pid}"
    assert f"checkpoint.dir={ck} is in use by another run {who}" in err
    assert sorted(p.name for p in ck.iterdir()) == [LOCK_NAME]
    holder.kill()
    holder.wait()
    assert import_hf.main([str(tmp_path / "hf"), str(ck), "data=synthetic"]) == 2  # past the lock now
    assert "not a transformers model folder" in capsys.readouterr().err
    assert sorted(p.name for p in ck.iterdir()) == []  # the stale lock taken over, then released


def test_a_second_export_into_one_out_is_refused(tmp_path, holder, capsys):
    out = tmp_path / "hf"
    lock_of(tmp_path / ".hf.lock", holder.pid)
    assert export_hf.main([str(tmp_path / "missing"), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"OUT={out} is in use by another run (host {socket.gethostname()}, pid {holder.pid}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.lock"]
