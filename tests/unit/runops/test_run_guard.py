"""The run guard owns what watches a run besides its steps: stop signals and timed saves are agreed at
check steps only, the watchdog starts after start-up and stops at the end, and a malformed fault spec is
bad input."""

from __future__ import annotations

import os
import signal

import pytest

from megaframe.checkpoint.resume import Resumed
from megaframe.checkpoint.resume_checks import Accounting
from megaframe.errors import ConfigError
from megaframe.parallel.mesh import single_process_mesh
from megaframe.runops.guard import RunGuard, checks_at
from megaframe.runops.signals import StopFlag
from megaframe.training.checkpointing import Checkpointer
from tests.distributed.cases import tiny_config


@pytest.fixture
def guard(tmp_path):
    cfg = tiny_config(
        [
            "train.max_steps=20",
            "train.log_interval=5",
            "train.signal_check_interval=4",
            "train.hang_timeout_s=600",
            f"run.dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt",
        ],
        1,
    )
    mesh = single_process_mesh("cpu")
    g = RunGuard(cfg.train, mesh, StopFlag(), cfg.run.dir, cfg.run.name)
    ckpt = Checkpointer(cfg, mesh, ("id", "owner"), Resumed(), Accounting(0, 0, 8), g.watch())
    yield g, ckpt
    g.close()


def test_check_steps_are_the_first_every_interval_log_and_last():
    t = tiny_config(["train.max_steps=20", "train.log_interval=5", "train.signal_check_interval=4"], 1).train
    assert [s for s in range(3, 21) if checks_at(s, 2, t)] == [3, 4, 5, 8, 10, 12, 15, 16, 20]


def test_a_signal_stops_the_run_at_the_next_check_step_only(guard):
    g, ckpt = guard
    os.kill(os.getpid(), signal.SIGUSR1)  # the StopFlag's handler keeps it
    assert g.decide(2, 0, ckpt) == (False, False)  # not a check step: no agreement, no stop
    assert g.decide(4, 0, ckpt) == (True, False)


def test_the_watchdog_runs_from_watch_to_close(guard):
    g, _ = guard
    assert g.watchdog is not None and g.watchdog._thread.is_alive()
    g.close()
    assert not g.watchdog._thread.is_alive()


def test_a_malformed_fault_spec_is_bad_input(monkeypatch):
    monkeypatch.setenv("MEGAFRAME_INJECT", "nap:rank=1")
    cfg = tiny_config([], 1)
    with pytest.raises(ConfigError):
        RunGuard(cfg.train, single_process_mesh("cpu"), None, "run", "name")
