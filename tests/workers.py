"""The units of work of `make test`'s pytest-xdist workers and the lane each takes them from:
tests/conftest.py hands them to xdist's scheduler and orders the tests; tests/unit/test_suite_workers.py
checks the split."""

from __future__ import annotations

PROCESS_FOLDERS = ("distributed", "e2e", "gpu")
"""How `make test`'s three pytest-xdist workers (`-n 3`, lanes gw0 gw1 gw2) share the suite on 2 cores.

gw0, the process lane: the tests of these folders start processes (the rank pool, torchrun, train.py) and
are CPU-bound on 2 cores: two of them at once each ran ~1.9x slower (gloo ranks wait for peers that are
not scheduled; measured over tests/distributed and tests/e2e), so this lane runs them a module at a time, in
order (a module's fixtures share runs between its tests).
gw1, the unit lane: every other test, each its own unit; when none is left it takes process modules from
the back of the process lane's queue, so the two CPU lanes end together whatever the split (before, with
two workers and the process tests one fixed unit, one lane idled for minutes at the end).
gw2, the waiting lane: the Slurm tests share the two-node local cluster and mostly wait (slurmctld's 30 s
checks, requeues, steps that sleep): one unit, started at once beside the CPU lanes instead of after them
(their ~6 minutes of waiting ran serially at the end of a lane before); then it helps as gw1 does."""
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
share the cores like a unit test, so they run on the unit lane, a module at a time (its tests share its
runs)."""


SHARED_SETUP = (
    "tests/unit/checkpoint/test_hf_import_checks.py",
    "tests/unit/data/test_prepare_concurrent.py",
    "tests/unit/data/test_prepare_tasks.py",
    "tests/unit/data/test_run_record.py",
    "tests/unit/evaluation/test_lm_eval.py",
    "tests/unit/optim/test_grad_bytes.py",
    "tests/unit/test_code_health.py",
)
"""Unit-test modules whose tests share a module fixture that costs seconds of CPU (a prepared corpus, trained
tokenizers, a checkpoint and its HF export, a transformers folder, counted optimizer steps, the package's code
statistics): one unit, so one worker builds it. As a unit per test, the lanes that took tests of one module
each built it again (the prepared corpus and lm-eval's checkpoint were built twice per run)."""


def folder_of(nodeid: str) -> str:
    parts = nodeid.split("/", 2)
    return parts[1] if parts[0] == "tests" and len(parts) == 3 else ""


def unit_of(nodeid: str) -> str:
    """The unit a test is handed out in: its module for the tests that start processes (run in order, the
    module's fixtures sharing runs between its tests: the docs journey's scratch checkout, a reference
    run) and for SHARED_SETUP's, "slurm" for the Slurm tests, the test itself otherwise."""
    module = nodeid.split("::")[0]
    if folder_of(nodeid) == "slurm":
        return "slurm"
    return module if folder_of(nodeid) in PROCESS_FOLDERS or module in SHARED_SETUP else nodeid


def lane_of(unit: str) -> str:
    """The lane whose queue holds a unit: a process module, the Slurm unit, or a unit test or one-process
    e2e module (those share the cores like a unit test)."""
    if unit == "slurm":
        return "slurm"
    module = unit.split("::")[0]
    return (
        "processes" if folder_of(unit) in PROCESS_FOLDERS and module not in ONE_PROCESS_AT_A_TIME else "units"
    )


def position(nodeid: str) -> int:
    """Where a test goes in the collection order: process tests, then the rest, then the Slurm tests (sort
    by it stably: within each part the tests keep their order)."""
    return {"processes": 0, "slurm": 2}.get(lane_of(unit_of(nodeid)), 1)


PREFERENCES = {
    "gw0": (("processes", "first"), ("units", "first"), ("slurm", "first")),
    "gw1": (("units", "first"), ("processes", "last"), ("slurm", "first")),
    "gw2": (("slurm", "first"), ("units", "first"), ("processes", "last")),
}
"""Per lane, where it takes its next unit from: a lane, and which end of that lane's queue."""


def pick(queue: list[str], worker: str) -> str:
    """The unit `worker` runs next out of the units still queued (in collection order)."""
    for lane, end in PREFERENCES.get(worker, PREFERENCES["gw1"]):
        mine = [u for u in queue if lane_of(u) == lane]
        if mine:
            return mine[0] if end == "first" else mine[-1]
    raise LookupError("no unit queued")


def scheduler(config, log):
    """xdist's scope scheduler over these units, each worker taking its next unit by its lane (`pick`).
    xdist's own `loadgroup` marks do not reach its scheduler under pytest 9 (xdist renames
    `item._nodeid`, pytest 9 reads `item._id`), hence units chosen from the path."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            scope = pick(list(self.workqueue), node.workerinput["workerid"])
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(i) for i, done in work_unit.items() if not done])

    config.option.loadscopereorder = False
    return Lanes(config, log)
