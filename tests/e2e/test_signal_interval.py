"""Stop signals are agreed only at check steps (train.signal_check_interval, the first, log and last
steps), and every rank still stops at the same one, with one committed checkpoint."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import TINY, start

pytestmark = pytest.mark.e2e


def test_sigterm_stops_every_rank_at_the_next_check_step(tmp_path):
    over = [
        "data=synthetic",
        *TINY,
        "train.max_steps=100000",
        "train.log_interval=5",
        "train.signal_check_interval=3",
        f"run.dir={tmp_path}",
    ]
    # torchrun as a fork of the suite's warm interpreter (helpers.start), its workers forks too: the subject
    # is the ranks' agreement on a stop step, not the interpreters' start. The agent's children are then the
    # workers' shims, which pass a signal on to their worker
    proc = start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "train.py",
            *over,
        ]
    )
    metrics = tmp_path / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None and time.time() - t0 < 120, "training did not start"
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(workers[-1]), signal.SIGTERM)  # one rank only: the other learns it at the check step
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    # all ranks stop promptly, at one step, with its checkpoint (was also test_fault_tolerance.py's
    # test_sigterm_on_one_rank_stops_all_at_one_step_with_a_checkpoint, the same torchrun)
    assert time.time() - t0 < 30 and proc.returncode == 0, out[-3000:]
    stop = int(re.search(r"stopping at step (\d+)", out).group(1))
    # one stop line for the run, from the logging rank; run.dir names the run, so no run.name=<torchrun's
    # uuid>
    lines = [ln for ln in out.splitlines() if "megaframe: stopping at step" in ln]
    assert len(lines) == 1 and f"run.dir={tmp_path}" in lines[0] and "run.name=" not in lines[0], lines
    # signalled after step 1's row (always logged), so after step 1's check: the next check step is 3, 5, 6...
    assert stop > 1 and (stop % 3 == 0 or stop % 5 == 0), stop
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{stop:08d}"
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == stop  # the stop step's row is logged
