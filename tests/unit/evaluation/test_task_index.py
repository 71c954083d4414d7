"""Which lm-eval task index a scoring call builds: a folder holding every named task is indexed alone
(lm-eval's own ~14,000 task YAMLs take 10 s to over a minute to index on 2 cores), once per process; a
name it lacks brings only the built-in YAMLs that can define it."""

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


@pytest.mark.parametrize(
    "name,folder",
    [
        # a tag one of whose tasks (arc_challenge) has it only through `include: arc_easy.yaml`
        ("ai2_arc", "arc"),
        # a group whose members are listed as dicts, one of them a tag (tinyTruthfulQA: mc1, mc2)
        ("tinyBenchmarks", "tinyBenchmarks"),
    ],
)
def test_a_hub_task_is_indexed_from_the_builtin_yamls_that_can_define_it(name, folder):
    """A name the include_path lacks: lm-eval's built-in YAMLs that mention it (or include one that does)
    are indexed alone, and give the entries lm-eval's own index of the task's folder gives."""
    from pathlib import Path

    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    from megaframe.evaluation.lm_tasks import task_manager

    own = TaskManager(include_path=str(Path(lm_eval.tasks.__file__).parent / folder), include_defaults=False)
    ours = task_manager([name], TASKS)
    assert {"megaframe_tiny_mc", *own.all_tasks} <= set(ours.all_tasks)
    assert len(ours.all_tasks) < 100  # not lm-eval's ~14,000
    for n in own.all_tasks:
        a, b = own.task_index[n], ours.task_index[n]
        assert (a.kind, a.cfg, a.tags, str(a.yaml_path)) == (b.kind, b.cfg, b.tags, str(b.yaml_path)), n
