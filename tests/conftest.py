import fcntl
import os
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, run

# Tests never reach the network: wandb offline (or disabled per test), no hub downloads.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.pop("WANDB_API_KEY", None)
# Point-to-point transfers follow NCCL's rules on gloo (DESIGN §1.3c, parallel/p2p_semantics.py): the rank
# pool and every torchrun a test starts inherit it, so each pipeline test checks what a GPU run needs.
os.environ.setdefault("MEGAFRAME_P2P_SEMANTICS", "nccl")

_pool = None


@pytest.fixture()
def pool():
    """The shared pool of 4 gloo ranks (see tests/distributed/pool.py)."""
    global _pool
    from tests.distributed.pool import RankPool

    if _pool is None or _pool.broken:
        _pool = RankPool(4)
    yield _pool


@pytest.fixture(scope="session")
def demo_prepared() -> Path:
    """The demo corpus prepared in the checkout, as `make data` leaves it (a fresh clone has none: CI runs
    `make test`, not `make data`). Prepared once per session (~15 s on 2 cores) for every test that reads
    it: the docs' journey, the rollback runs, the corrupt-data copies. Tests only read it (a test that
    damages data damages its own copy)."""
    path = ROOT / "data" / "demo" / "prepared"
    path.parent.mkdir(parents=True, exist_ok=True)
    # `make test` runs two pytest workers: the first to ask prepares, the other waits and finds it done
    with open(path.parent / ".prepare-by-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "meta.json").is_file():
            res = run([sys.executable, "-m", "megaframe.data.prepare"], timeout=300)
            assert res.returncode == 0, res.stderr[-2000:]
    return path


PROCESS_FOLDERS = ("distributed", "e2e", "gpu", "slurm")
"""How `make test`'s two pytest-xdist workers share the suite (`-n 2`). The tests of these folders start
processes (the rank pool, torchrun, train.py, Slurm jobs) and are CPU-bound on 2 cores: two of them at once
each ran ~1.5-1.9x slower (gloo ranks wait for peers that are not scheduled; measured over tests/distributed
and tests/e2e) and the Slurm jobs up to 4x, so they form one unit of work that one worker runs in order
(the Slurm tests share the two-node local cluster anyway). Each one-process test is a unit of its own:
they go to the other worker and fill the time the process tests leave."""


def _unit_of(nodeid: str) -> str:
    parts = nodeid.split("/", 2)
    return "processes" if parts[0] == "tests" and len(parts) == 3 and parts[1] in PROCESS_FOLDERS else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # xdist's own `loadgroup` marks do not reach the scheduler under pytest 9 (xdist renames
    # `item._nodeid`, pytest 9 reads `item._id`): the units are chosen from the path instead
    from xdist.scheduler import LoadScopeScheduling

    class FolderUnits(LoadScopeScheduling):
        """Largest unit first (xdist's reorder): the process tests start at once."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    return FolderUnits(config, log)


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()
