"""The local Slurm cluster for the `slurm` tests: started once per session, stopped at its end.

`scripts/slurm/local_cluster.sh start` installs Debian's slurm and munge packages when missing and
brings up munged, slurmctld and two slurmd's (emulated nodes n1, n2). The tests are skipped only when
that is impossible here (not root, or apt cannot install the packages); CI runs as root, so they run.
A cluster that was already up is used as is; one started by a test session is stopped by the last
session that uses it (a shared lock lets concurrent sessions share it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "local_cluster.sh"
STATE = Path("/run/megaframe_slurm_local")
MARKER = STATE / "started_by_pytest"
USERS_LOCK = STATE / "pytest-users.lock"


def _cluster(cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), cmd], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip(
            "the local Slurm cluster needs root (scripts/slurm/local_cluster.sh installs and starts daemons)"
        )
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("no Slurm installed and no apt-get to install it")
    STATE.mkdir(parents=True, exist_ok=True)
    users = open(USERS_LOCK, "a")
    fcntl.flock(users, fcntl.LOCK_SH)  # before `start`: a session ending now must not stop it under us
    try:
        was_up = shutil.which("sbatch") is not None and _cluster("status", 30).returncode == 0
        res = _cluster("start", 600)
        if res.returncode == 3:
            why = (res.stderr.strip().splitlines() or ["apt-get failed"])[-1]
            pytest.skip(f"cannot install Slurm/munge packages: {why}")
        assert res.returncode == 0, f"local_cluster.sh start failed:\n{res.stdout}\n{res.stderr}"
        if not was_up:
            MARKER.touch()
        yield
    finally:
        try:  # the last session still using a cluster that a test session started stops it
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            last = True
        except OSError:
            last = False
        if last and MARKER.exists():
            _cluster("stop", 300)
            MARKER.unlink(missing_ok=True)
        users.close()
