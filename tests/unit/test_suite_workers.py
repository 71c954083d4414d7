"""How `make test`'s pytest-xdist workers share the suite (tests/workers.py): a process-starting test module
is one unit, the Slurm tests another, every other test its own; each worker takes its lane's units; the hand
list of one-process e2e modules names modules that exist and start no ranks."""

from __future__ import annotations

import re

from tests.e2e.helpers import ROOT
from tests.workers import ONE_PROCESS_AT_A_TIME, next_unit, position, unit_of

# what starts several training processes at once in a test module's own code
LAUNCHES_RANKS = re.compile(r"\bnproc\b|torch\.distributed\.run|--nproc-per-node|\bpool\b|sbatch\(")


def test_a_process_module_is_one_unit_and_the_rest_are_their_own():
    assert unit_of("tests/distributed/test_zero.py::test_x[dp2]") == "tests/distributed/test_zero.py"
    torchrun = "tests/e2e/test_train_cli.py::test_torchrun_tp4_sp_matches_one_process"
    assert unit_of(torchrun) == "tests/e2e/test_train_cli.py"
    assert unit_of("tests/gpu/test_cuda_path.py::test_cuda_run_matches_cpu") == "tests/gpu/test_cuda_path.py"
    assert unit_of("tests/slurm/test_sweep.py::test_expand_is_hydra_multirun_order") == "slurm"
    for nodeid in (
        "tests/unit/config/test_config_frozen.py::test_a",
        "tests/e2e/test_docs_commands.py::test_page_commands_run_in_order[README.md]",
    ):
        assert unit_of(nodeid) == nodeid
    # collected in this order: the process tests first, the Slurm tests last
    ids = ("tests/e2e/test_fp8.py::t", "tests/unit/test_plot.py::t", "tests/slurm/test_sweep.py::t")
    assert [position(nodeid) for nodeid in ids] == [0, 1, 2]


def test_each_lane_takes_its_units_and_the_first_two_meet_in_the_process_modules():
    a, b, c = "tests/e2e/test_a.py", "tests/e2e/test_b.py", "tests/e2e/test_c.py"
    one, two = "tests/unit/test_u.py::t1", "tests/unit/test_u.py::t2"
    units = [a, b, c, one, two, "slurm"]
    # three workers: processes from the front, single tests then processes from the back, Slurm alone
    assert [next_unit(units, lane, 3) for lane in (0, 1, 2)] == [a, one, "slurm"]
    assert next_unit([a, b, c], 1, 3) == c
    assert next_unit([a, b, c, one], 2, 3) is None  # the Slurm worker stops after its unit
    assert next_unit([one, two, "slurm"], 0, 3) == one  # the process lane helps with the rest at the end
    # two workers: the Slurm unit after the single tests; one worker: collection order
    assert next_unit(["slurm", a], 1, 2) == "slurm" and next_unit(["slurm", a], 0, 2) == a
    assert next_unit(units[::-1], 0, 1) == "slurm"
    assert next_unit([], 0, 3) is None


def test_the_one_process_modules_exist_and_start_no_ranks():
    for path in ONE_PROCESS_AT_A_TIME:
        source = (ROOT / path).read_text()
        assert not LAUNCHES_RANKS.search(source), f"{path} starts ranks: move it out of ONE_PROCESS_AT_A_TIME"
