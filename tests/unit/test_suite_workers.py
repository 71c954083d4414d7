"""How `make test`'s pytest-xdist workers share the suite (tests/workers.py): the process-starting tests are
handed out a module at a time to the process lane, the Slurm tests as one unit to the waiting lane, every
other test on its own to the unit lane, which then takes process modules from the back; the hand list of
one-process e2e modules names modules that exist and start no ranks."""

from __future__ import annotations

import re

from tests.e2e.helpers import ROOT
from tests.workers import ONE_PROCESS_AT_A_TIME, SHARED_SETUP, lane_of, pick, position, unit_of

# what starts several training processes at once in a test module's own code
LAUNCHES_RANKS = re.compile(r"\bnproc\b|torch\.distributed\.run|--nproc-per-node|\bpool\b|sbatch\(")


def test_process_tests_go_by_module_and_the_rest_are_their_own():
    zero = "tests/distributed/optim/test_zero.py"
    assert unit_of(f"{zero}::test_x[dp2]") == unit_of(f"{zero}::test_y") == zero
    assert unit_of("tests/e2e/test_train_cli.py::test_torchrun_tp4_sp_matches_one_process") == (
        "tests/e2e/test_train_cli.py"
    )
    assert unit_of("tests/gpu/test_cuda_path.py::test_cuda_run_matches_cpu") == "tests/gpu/test_cuda_path.py"
    assert unit_of("tests/slurm/test_sweep.py::test_expand_is_hydra_multirun_order") == "slurm"
    assert (
        unit_of("tests/unit/config/test_config_frozen.py::test_a")
        == "tests/unit/config/test_config_frozen.py::test_a"
    )
    # a unit module whose tests share a costly module fixture: one unit, on the unit lane
    shared = "tests/unit/evaluation/test_lm_eval.py"
    assert unit_of(f"{shared}::test_rolling_and_generate_until") == shared and lane_of(shared) == "units"
    # a one-process e2e module: one unit (its tests share the module's runs), on the unit lane
    docs = "tests/e2e/test_docs_commands.py"
    assert unit_of(f"{docs}::test_page_commands_run_in_order[README.md]") == docs and lane_of(docs) == "units"
    assert lane_of(zero) == "processes" and lane_of("slurm") == "slurm"
    # collected in this order: the process tests first, the Slurm tests last
    ids = ("tests/e2e/test_fp8.py::t", "tests/unit/test_plot.py::t", "tests/slurm/test_sweep.py::t")
    assert [position(nodeid) for nodeid in ids] == [0, 1, 2]


def test_each_lane_takes_its_own_work_then_helps_from_the_other_end():
    queue = ["tests/distributed/a.py", "tests/e2e/b.py", "tests/unit/c.py::t", "tests/unit/d.py::t", "slurm"]
    assert pick(queue, "gw0") == "tests/distributed/a.py"
    assert pick(queue, "gw1") == "tests/unit/c.py::t"
    assert pick(queue, "gw2") == "slurm"
    # the unit lane, its own tests done, takes the last process module: the lanes meet in the middle
    assert pick(queue[:2] + ["slurm"], "gw1") == "tests/e2e/b.py"
    assert pick(["tests/unit/d.py::t"], "gw0") == pick(["tests/unit/d.py::t"], "gw2") == "tests/unit/d.py::t"


def test_the_shared_setup_modules_exist_and_share_a_module_fixture():
    for path in SHARED_SETUP:
        assert 'scope="module"' in (ROOT / path).read_text(), f"{path}: no module fixture to share"


def test_the_one_process_modules_exist_and_start_no_ranks():
    for path in ONE_PROCESS_AT_A_TIME:
        source = (ROOT / path).read_text()
        assert not LAUNCHES_RANKS.search(source), f"{path} starts ranks: move it out of ONE_PROCESS_AT_A_TIME"
