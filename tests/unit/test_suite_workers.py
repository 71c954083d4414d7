"""How `make test`'s two pytest-xdist workers share the suite (tests/workers.py): the process-starting tests
stay one unit run in order, the Slurm tests another, every other test its own; the hand list of one-process
e2e modules names modules that exist and start no ranks."""

from __future__ import annotations

import re

from tests.e2e.helpers import ROOT
from tests.workers import ONE_PROCESS_AT_A_TIME, position, unit_of

# what starts several training processes at once in a test module's own code
LAUNCHES_RANKS = re.compile(r"\bnproc\b|torch\.distributed\.run|--nproc-per-node|\bpool\b|sbatch\(")


def test_process_tests_share_one_unit_and_the_rest_are_their_own():
    assert unit_of("tests/distributed/optim/test_zero.py::test_x[dp2]") == "processes"
    assert unit_of("tests/e2e/test_train_cli.py::test_torchrun_tp4_sp_matches_one_process") == "processes"
    assert unit_of("tests/gpu/test_cuda_path.py::test_cuda_run_matches_cpu") == "processes"
    assert unit_of("tests/slurm/test_sweep.py::test_expand_is_hydra_multirun_order") == "slurm"
    for nodeid in (
        "tests/unit/config/test_config_frozen.py::test_a",
        "tests/e2e/test_docs_commands.py::test_page_commands_run_in_order[README.md]",
    ):
        assert unit_of(nodeid) == nodeid
    # handed out in this order: the process tests first, the Slurm tests last
    ids = ("tests/e2e/test_fp8.py::t", "tests/unit/test_plot.py::t", "tests/slurm/test_sweep.py::t")
    assert [position(nodeid) for nodeid in ids] == [0, 1, 2]


def test_the_one_process_modules_exist_and_start_no_ranks():
    for path in ONE_PROCESS_AT_A_TIME:
        source = (ROOT / path).read_text()
        assert not LAUNCHES_RANKS.search(source), f"{path} starts ranks: move it out of ONE_PROCESS_AT_A_TIME"
