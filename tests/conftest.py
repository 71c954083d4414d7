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


PROCESS_FOLDERS = ("distributed", "e2e", "gpu")
"""How `make test`'s two pytest-xdist workers share the suite (`-n 2`). The tests of these folders start
processes (the rank pool, torchrun, train.py) and are CPU-bound on 2 cores: two of them at once each ran
~1.9x slower (gloo ranks wait for peers that are not scheduled; measured over tests/distributed and
tests/e2e), so they form one unit of work that one worker runs in order. The Slurm tests share the two-node
local cluster and mostly wait (slurmctld's checks, requeues, sleeping steps): one unit, scheduled last, so
their waits overlap the process tests' tail. Each other test is a unit of its own: those fill the other
worker (measured: the pair does ~1.25x the work of one serial run)."""
ONE_PROCESS_AT_A_TIME = (
    "tests/e2e/test_checkpoint_pointer.py",
    "tests/e2e/test_damaged_metadata.py",
    "tests/e2e/test_data_resume_cli.py",
    "tests/e2e/test_demo_pipeline.py",
    "tests/e2e/test_docs_commands.py",
    "tests/e2e/test_full_disk.py",
    "tests/e2e/test_full_disk_tools.py",
    "tests/e2e/test_lost_work_cli.py",
    "tests/e2e/test_user_guidance_cli.py",
)
"""End-to-end modules whose tests start one single-threaded process at a time (train.py, the tools): they
share the cores like a unit test, so they fill the other worker too."""
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per process under two workers: torch's idle intra-op threads spin-wait for work and took
    # the cores the other worker's ranks needed (measured: with 2 threads the pair ran slower than one
    # serial run). Set before anything imports torch; every process a test starts inherits it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _folder(nodeid: str) -> str:
    parts = nodeid.split("/", 2)
    return parts[1] if parts[0] == "tests" and len(parts) == 3 else ""


def _unit_of(nodeid: str) -> str:
    if nodeid.split("::")[0] in ONE_PROCESS_AT_A_TIME:
        return nodeid
    folder = _folder(nodeid)
    return "processes" if folder in PROCESS_FOLDERS else "slurm" if folder == "slurm" else nodeid


def pytest_collection_modifyitems(config, items):
    """Under the workers, the process tests first and the Slurm tests last: the scheduler hands out units in
    collection order (a stable sort: within each part the tests keep theirs)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        first = {"processes": 0, "slurm": 2}
        items.sort(key=lambda item: first.get(_unit_of(item.nodeid), 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # xdist's own `loadgroup` marks do not reach the scheduler under pytest 9 (xdist renames
    # `item._nodeid`, pytest 9 reads `item._id`): the units are chosen from the path instead
    from xdist.scheduler import LoadScopeScheduling

    class FolderUnits(LoadScopeScheduling):
        """Units in collection order (no reorder by size): the process tests first, the Slurm tests last."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    config.option.loadscopereorder = False
    return FolderUnits(config, log)


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()
