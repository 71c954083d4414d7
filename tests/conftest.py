import os

import pytest

# Tests never reach the network: wandb offline (or disabled per test), no hub downloads.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.pop("WANDB_API_KEY", None)

_pool = None


@pytest.fixture()
def pool():
    """The shared pool of 4 gloo ranks (see tests/distributed/pool.py)."""
    global _pool
    from tests.distributed.pool import RankPool

    if _pool is None or _pool.broken:
        _pool = RankPool(4)
    yield _pool


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()
