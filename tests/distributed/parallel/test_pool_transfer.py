"""What crosses the rank pool's pipes crosses by value: a test may keep a job's results (the layout tests keep
their one-process references for the module) without the pytest worker keeping a descriptor for each of
their tensors, and the tensors a test passes stay its own memory."""

import os

import pytest
import torch

pytestmark = pytest.mark.distributed


def _shared_memory_descriptors() -> int:
    """This process's open descriptors on shared-memory files (torch's tensors sent between processes)."""
    fds = os.listdir("/proc/self/fd")
    return sum(_target(fd).startswith("/dev/shm/") for fd in fds)


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        return ""


def _tensors(mesh, count: int, given: torch.Tensor) -> list[torch.Tensor]:
    return [given + i for i in range(count)]


def test_results_kept_by_a_test_hold_no_descriptors(pool):
    before = _shared_memory_descriptors()
    given = torch.zeros(8)
    kept = pool.run(_tensors, 2, 16, given)
    assert [len(r) for r in kept] == [16, 16] and float(kept[1][15][0]) == 15.0
    assert _shared_memory_descriptors() == before
    assert not given.is_shared()
