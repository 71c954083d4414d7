"""In-loop downstream scoring on 2 ranks when a task fails to load on one rank only (a dataset one node
cannot fetch): every rank skips that task, none waits alone in its scoring collectives, the logging rank
names the failed rank and its reason, and the next task is scored alike on both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")

from tests.distributed.downstream_cases import FLAKY_PY, FLAKY_YAML, score_with_ranks_failing  # noqa: E402
from tests.unit.evaluation.test_lm_eval import TASKS, TINY  # noqa: E402

pytestmark = pytest.mark.distributed


def test_a_task_failing_on_one_rank_is_skipped_on_every_rank_and_named(pool, tmp_path):
    from megaframe.data.tokenizer import train_tokenizer

    text = (Path(TASKS) / "tiny_mc.jsonl").read_text().splitlines() * 20
    train_tokenizer(text, 360, tmp_path / "tokenizer", num_threads=1)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("tiny_mc.yaml", "tiny_mc.py", "tiny_mc.jsonl"):
        shutil.copy(Path(TASKS) / name, tasks / name)
    (tasks / "tiny_flaky.py").write_text(FLAKY_PY)
    (tasks / "tiny_flaky.yaml").write_text(FLAKY_YAML)
    # rank 1 only, then the logging rank (0) only, then every rank
    got = pool.run(
        score_with_ranks_failing, 2, TINY, str(tmp_path / "tokenizer.model"), str(tasks), ["1", "0", "0,1"]
    )
    for case, failed in enumerate(["rank 1", "rank 0", "ranks 0, 1"]):
        (row0, err0), (row1, err1) = got[0][case], got[1][case]
        assert row0 == row1 and set(row0) == {
            "downstream/megaframe_tiny_mc/acc",
            "downstream/megaframe_tiny_mc/acc_norm",
        }, (case, row0, row1)
        line = f"downstream task megaframe_tiny_flaky at step 1 failed ({failed}: ValueError: task(s)"
        assert line in err0 and "the hub cannot be reached from this node" in err0, (case, err0)
        assert "megaframe" not in err1, (case, err1)  # one line for the run: the logging rank's
