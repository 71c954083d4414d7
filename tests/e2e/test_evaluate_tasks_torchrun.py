"""`python -m megaframe.evaluate checkpoint=... +tasks=...` under torchrun scores the checkpoint in the layout
its overrides name (here pp2 over 2 processes) and prints the one-process line, digit for digit."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.helpers import ROOT, TINY, run, train

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")
pytestmark = pytest.mark.e2e

TASK = [
    "+tasks=megaframe_tiny_mc",
    f"+include_path={ROOT / 'tests' / 'data' / 'lm_eval_tasks'}",
    "+batch_size=4",
]


def test_torchrun_pp2_scores_like_one_process(tmp_path):
    res = train(TINY + ["train.max_steps=2", f"run.dir={tmp_path}"])
    assert res.returncode == 0, res.stderr[-2000:]
    ckpt = f"checkpoint={tmp_path / 'checkpoints'}"
    one = run([sys.executable, "-m", "megaframe.evaluate", ckpt, *TASK], timeout=300, HF_HUB_OFFLINE="1")
    assert one.returncode == 0, one.stderr[-2000:]
    two = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "megaframe.evaluate",
            ckpt,
            *TASK,
            "parallel.pp=2",
        ],
        timeout=400,
        HF_HUB_OFFLINE="1",
    )
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [ln for ln in one.stdout.splitlines() if "megaframe_tiny_mc acc" in ln]
    assert (
        len(lines) == 1 and [ln for ln in two.stdout.splitlines() if "megaframe_tiny_mc acc" in ln] == lines
    )
