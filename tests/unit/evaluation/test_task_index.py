"""Which lm-eval task index a scoring call builds: a folder holding every named task is indexed alone
(lm-eval's own ~14,000 task YAMLs take 10 s to over a minute to index on 2 cores), once per process."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import ROOT

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")

TASKS = str(ROOT / "tests" / "data" / "lm_eval_tasks")


def test_a_folder_with_every_named_task_is_indexed_alone_and_once():
    from megaframe.evaluation.lm_tasks import task_manager

    manager = task_manager(["megaframe_tiny_mc"], TASKS)
    assert sorted(manager.all_tasks) == ["megaframe_tiny_broken", "megaframe_tiny_mc"]
    assert task_manager(["megaframe_tiny_mc", "megaframe_tiny_broken"], TASKS) is manager
