import fcntl
import os
import sys
from pathlib import Path

import pytest

from tests import workers
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
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per process under two workers: torch's idle intra-op threads spin-wait for work and took
    # the cores the other worker's ranks needed (measured: with 2 threads the pair ran slower than one
    # serial run). Set before anything imports torch; every process a test starts inherits it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# A process that compiles (train.compile=true) compiles in-process instead of starting inductor's pool of
# compile workers, one per core (~10 s of CPU each time on 2 cores for a tiny model's few kernels; the
# generated code is the same); every process a test starts inherits it: the rank pool's ranks, torchrun's
# workers, the warm server's forks (the compiler is imported after their environment is set)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

_pool = None


@pytest.fixture()
def pool():
    """The shared pool of 4 gloo ranks (see tests/distributed/pool.py)."""
    global _pool
    from tests.distributed.pool import RankPool

    if _pool is None or _pool.broken:
        if _pool is not None:
            _pool.close()  # its pipes, else held open by this worker for the rest of the session
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


def pytest_collection_modifyitems(config, items):
    """Under the workers, the order the scheduler hands out units in (tests/workers.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: workers.position(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return workers.scheduler(config, log)


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()
