"""In-loop downstream evaluation: train.py with train.downstream_interval logs downstream/<task>/<metric> to
metrics.jsonl at the due steps, and a task that raises costs one stderr line while training goes on."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import ROOT, TINY, metrics, train

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")
pytestmark = pytest.mark.e2e

TASKS = ROOT / "tests" / "data" / "lm_eval_tasks"


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["parallel.pp=2"])])
def test_downstream_scores_logged_and_a_failing_task_does_not_stop_the_run(tmp_path, nproc, layout):
    """pp2: the rank that logs is the last stage's (LOCAL_RANK 1), where lm-eval itself would return
    nothing. Ranks started as srun does (LOCAL_RANK set, no torchrun agent): the launcher is not the
    subject."""
    res = train(
        TINY
        + layout
        + [
            "model.seq_length=64",
            "train.max_steps=4",
            "train.downstream_interval=2",
            "train.downstream_tasks=[megaframe_tiny_mc,megaframe_tiny_broken]",
            f"train.downstream_include_path={TASKS}",
            "train.downstream_limit=6",
            "train.downstream_batch_size=4",
            f"run.dir={tmp_path}",
        ],
        nproc=nproc,
        timeout=600,
        launcher="env",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["step"]: r for r in metrics(tmp_path)}
    for step in (2, 4):
        assert 0.0 <= rows[step]["downstream/megaframe_tiny_mc/acc"] <= 1.0, rows[step]
        assert "downstream/megaframe_tiny_mc/acc_norm" in rows[step]
        assert not any("tiny_broken" in k for k in rows[step])
    assert "downstream/megaframe_tiny_mc/acc" not in rows.get(1, {})
    failed = [line for line in res.stderr.splitlines() if "megaframe_tiny_broken" in line]
    assert len(failed) == 2 and all("training goes on" in line for line in failed), failed  # one per due step
    assert "Traceback" not in res.stderr
    assert "downstream step 2: megaframe_tiny_mc acc" in res.stdout
