"""The units of work of `make test`'s two pytest-xdist workers: tests/conftest.py hands them to xdist's
scheduler and orders the tests; tests/unit/test_suite_workers.py checks the split."""

from __future__ import annotations

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
    "tests/e2e/test_goodput_faults.py",
    "tests/e2e/test_logging_cli.py",
    "tests/e2e/test_lost_work_cli.py",
    "tests/e2e/test_user_guidance_cli.py",
)
"""End-to-end modules whose tests start one single-threaded process at a time (train.py, the tools): they
share the cores like a unit test, so they fill the other worker too."""


def folder_of(nodeid: str) -> str:
    parts = nodeid.split("/", 2)
    return parts[1] if parts[0] == "tests" and len(parts) == 3 else ""


def unit_of(nodeid: str) -> str:
    if nodeid.split("::")[0] in ONE_PROCESS_AT_A_TIME:
        return nodeid
    folder = folder_of(nodeid)
    return "processes" if folder in PROCESS_FOLDERS else "slurm" if folder == "slurm" else nodeid


def position(nodeid: str) -> int:
    """Where a test goes in the collection order the scheduler hands out: process tests, then the rest,
    then the Slurm tests (sort by it stably: within each part the tests keep their order)."""
    return {"processes": 0, "slurm": 2}.get(unit_of(nodeid), 1)


def scheduler(config, log):
    """xdist's scope scheduler over these units, in collection order (no reorder by size): the process tests
    first, the Slurm tests last. xdist's own `loadgroup` marks do not reach its scheduler under pytest 9
    (xdist renames `item._nodeid`, pytest 9 reads `item._id`), hence units chosen from the path."""
    from xdist.scheduler import LoadScopeScheduling

    class FolderUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return FolderUnits(config, log)
