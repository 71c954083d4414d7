"""The units of work of `make test`'s pytest-xdist workers and which worker takes which: tests/conftest.py
hands them to xdist's scheduler and orders the tests; tests/unit/test_suite_workers.py checks the split."""

from __future__ import annotations

PROCESS_FOLDERS = ("distributed", "e2e", "gpu")
"""How `make test`'s three pytest-xdist workers (`-n 3`) share the suite, as lanes. The tests of these folders
start processes (the rank pool, torchrun, train.py) and are CPU-bound on 2 cores: two of them at once each
ran ~1.9x slower (gloo ranks wait for peers that are not scheduled; measured over tests/distributed and
tests/e2e), so the process lane (the first worker) runs them a module at a time, in order, while the
other tests, each a unit of its own, fill the second worker (measured: the pair does ~1.25x the work of one
serial run). When the other tests run out, the second worker takes process modules from the back of the
queue, so the two lanes end together. The Slurm tests share the two-node local cluster and mostly wait
(slurmctld's checks, requeues, sleeping steps): one unit, from the start, on the third worker, which
then stops; with two workers they follow the other tests on the second."""
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


def folder_of(nodeid: str) -> str:
    parts = nodeid.split("/", 2)
    return parts[1] if parts[0] == "tests" and len(parts) == 3 else ""


def kind_of(nodeid: str) -> str:
    """processes | slurm | single, of a test id or of a unit."""
    if nodeid.split("::")[0] in ONE_PROCESS_AT_A_TIME:
        return "single"
    if nodeid == "slurm":  # the unit's own name
        return "slurm"
    folder = folder_of(nodeid)
    return "processes" if folder in PROCESS_FOLDERS else "slurm" if folder == "slurm" else "single"


def unit_of(nodeid: str) -> str:
    """A process test's module, "slurm", or the test itself."""
    kind = kind_of(nodeid)
    return nodeid.split("::")[0] if kind == "processes" else "slurm" if kind == "slurm" else nodeid


def position(nodeid: str) -> int:
    """Where a test goes in the collection order (sort by it stably: within each part the tests keep their
    order): process tests, then the rest, then the Slurm tests."""
    return {"processes": 0, "slurm": 2}.get(kind_of(nodeid), 1)


def next_unit(units: list[str], lane: int, workers: int) -> str | None:
    """The unit (of those waiting, in collection order) the worker of this lane runs next; None: it stops.
    Lane 0 takes the process modules from the front, then the rest; lane 1 the single tests, then the
    process modules from the back; lane 2 (with three workers) the Slurm unit only."""
    by = {k: [u for u in units if kind_of(u) == k] for k in ("processes", "single", "slurm")}
    if workers == 1:
        return units[0] if units else None
    if lane == 2:
        return by["slurm"][0] if by["slurm"] else None
    slurm = by["slurm"] if workers == 2 else []  # no Slurm lane: after the single tests
    if lane == 0:
        order = by["processes"] + by["single"] + slurm
    else:
        order = by["single"] + slurm + by["processes"][::-1]
    return order[0] if order else None


def scheduler(config, log):
    """xdist's scope scheduler over these units, each worker taking its lane's next unit (`next_unit`; the
    worker's number is its lane). xdist's own `loadgroup` marks do not reach its scheduler under pytest 9
    (xdist renames `item._nodeid`, pytest 9 reads `item._id`), hence units chosen from the path."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _reschedule(self, node) -> None:
            if not node.shutting_down and self.workqueue and self._next(node) is None:
                node.shutdown()  # nothing left for its lane: it ends after the tests it holds
                return
            super()._reschedule(node)

        def _next(self, node) -> str | None:
            lane = int(node.gateway.id.removeprefix("gw"))
            return next_unit(list(self.workqueue), lane, len(self.nodes))

        def _assign_work_unit(self, node) -> None:
            scope = self._next(node)
            if scope is None:
                node.shutdown()
                return
            self.workqueue.move_to_end(scope, last=False)  # the parent takes the first unit
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False
    return Lanes(config, log)
