"""A pool worker that dies (a crash in native code, SIGSEGV) fails the test it was serving with the exit code,
and the next test gets a fresh pool: one crash costs one test, not every pool test after it."""

import os
import signal

import pytest

from tests.distributed.pool import RankPool

pytestmark = pytest.mark.distributed


def _rank(mesh):
    return mesh.rank


def _crash_rank_1(mesh):
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return mesh.rank


def test_a_dead_worker_is_named_and_the_pool_marked_broken():
    pool = RankPool(2)
    try:
        assert pool.run(_rank, 2) == [0, 1]
        with pytest.raises(RuntimeError, match=r"exit codes of the dead ranks: \{1: -11\}"):
            pool.run(_crash_rank_1, 2)
        assert pool.broken  # the `pool` fixture starts a new one for the next test
    finally:
        pool.close()
