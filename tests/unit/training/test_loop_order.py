"""The step loop's order, in one process with the loop's parts recorded: a step due a save is saved before
its evaluation (a crash or hang kill while evaluating it never repeats on a restart), and a stop signal that
arrives during an evaluation stops the run at that step, saved after the evaluation."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from megaframe.config import load_config
from megaframe.parallel.mesh import single_process_mesh
from megaframe.runops.signals import StopFlag
from megaframe.training import trainer


class Recorder:
    """Stands for trainer.Loop: records each verb; evaluation runs `on_eval(step)` first."""

    def __init__(self, calls: list, on_eval):
        self.calls, self.on_eval = calls, on_eval
        self.ckpt = SimpleNamespace(
            writing=lambda: False, overdue=lambda: False, poll=lambda all_written: None
        )

    def batches(self, step):
        return []

    def step(self, step, batches):
        self.calls.append(("step", step))

    def save(self, step, due, last):
        if due:
            self.calls.append(("save", step, last))
        return due

    def evaluate(self, step):
        self.on_eval(step)
        self.calls.append(("evaluate", step))
        return None, True

    def meter(self, step, res, val, stopping):
        self.calls.append(("meter", step, stopping))

    def finish(self, start, step):
        self.calls.append(("finish", step))

    def close(self):
        pass


def run_loop(monkeypatch, tmp_path, calls: list, on_eval, *over) -> list:
    """trainer.train with its parts recorded into `calls` (one process, synthetic data, 3 steps)."""
    cfg = load_config(
        ["data=synthetic", "train.max_steps=3", "train.log_interval=10", f"run.dir={tmp_path}", *over],
        world_size=1,
        check_data=False,
    )
    su = SimpleNamespace(cfg=cfg, resumed=SimpleNamespace(step=0))
    monkeypatch.setattr(trainer, "set_up", lambda *a, **k: su)
    monkeypatch.setattr(trainer, "announce", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "Loop", lambda *a, **k: Recorder(calls, on_eval))
    trainer.train(cfg, single_process_mesh(), StopFlag())
    return calls


def test_the_loop_order_is_step_save_evaluate_meter(monkeypatch, tmp_path):
    calls = run_loop(monkeypatch, tmp_path, [], lambda step: None, "checkpoint.interval=2")
    assert calls == [
        ("step", 1),
        ("evaluate", 1),
        ("meter", 1, False),
        ("step", 2),
        ("save", 2, False),
        ("evaluate", 2),
        ("meter", 2, False),
        ("step", 3),
        ("save", 3, True),
        ("evaluate", 3),
        ("meter", 3, False),
        ("finish", 3),
    ]


def test_a_crash_while_evaluating_a_saved_step_leaves_that_step_saved(monkeypatch, tmp_path):
    """The restart resumes after step 2 instead of running into the same evaluation again."""

    def crash(step):
        if step == 2:
            raise RuntimeError("evaluation crashed")

    calls: list = []
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        run_loop(monkeypatch, tmp_path, calls, crash, "checkpoint.interval=2")
    assert calls[-1] == ("save", 2, False), calls


def test_a_signal_during_an_evaluation_stops_at_that_step_saved_after_it(monkeypatch, tmp_path):
    """Step 2 is no check step (signal_check_interval=10): the evaluation makes it one."""
    flag: list = []

    def signalled(step):
        if step == 2:
            signal.raise_signal(signal.SIGUSR1)
            flag.append(step)

    calls = run_loop(monkeypatch, tmp_path, [], signalled, "checkpoint.interval=0")
    assert flag == [2]
    assert calls[3:] == [
        ("step", 2),
        ("evaluate", 2),
        ("meter", 2, True),
        ("save", 2, True),
        ("finish", 2),
    ], calls
