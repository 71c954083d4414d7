"""Issue 26 end to end: the red team's reproductions through train.py and the tools, each a one-line
exit 2 (or the right checkpoint) where the code before lost work or used the wrong branch."""
import json
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import TINY, train

pytestmark = pytest.mark.e2e

SYN = ["data=synthetic", *TINY, "train.log_interval=1", "logging.wandb.mode=disabled"]


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megaframe: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_a_checkpoint_dir_owned_by_a_live_job_is_refused_before_any_step(tmp_path):
    """L1: two jobs with their own run.dir and one checkpoint.dir both exited 0, the second replacing
    every checkpoint of the first."""
    shared = tmp_path / "shared_ck"
    shared.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (shared / "megaframe.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                           "job": "", "since": time.time()}))
        res = train(SYN + ["train.max_steps=2", f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={shared}"],
                    timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"checkpoint.dir={shared} is in use by another run (host {socket.gethostname()}, pid {holder.pid}" \
        in _error_line(res.stderr)
    assert sorted(p.name for p in shared.iterdir()) == ["megaframe.lock"]  # no step folder, no `latest`
    assert not (tmp_path / "b" / "megaframe.lock").exists()  # its own run.dir lock given back
