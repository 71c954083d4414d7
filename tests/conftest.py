import os

import pytest

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


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()
