"""The `megaframe` lm-eval model gives the one-process numbers under tp2, pp2 and dp2 (each dp rank scores its
share, the shares gathered): the local multiple-choice task's accuracy equal and every choice's
log-likelihood to 1e-6 (relative), on every rank."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")

from megaframe.checkpoint import sharded  # noqa: E402
from megaframe.config import load_config  # noqa: E402
from megaframe.parallel.mesh import single_process_mesh  # noqa: E402
from tests.distributed.lm_eval_cases import score_local_task  # noqa: E402
from tests.forms import build_model  # noqa: E402
from tests.unit.evaluation.test_lm_eval import TASK, TASKS, TINY, WeightsOnly, worst_gap  # noqa: E402

pytestmark = pytest.mark.distributed


def test_local_task_scores_alike_under_tp_pp_dp(pool, tmp_path):
    from megaframe.data.tokenizer import train_tokenizer

    text = [line for line in (Path(TASKS) / "tiny_mc.jsonl").read_text().splitlines()] * 20
    train_tokenizer(text, 360, tmp_path / "tokenizer", num_threads=1)
    cfg = load_config(TINY, world_size=1, check_data=False)
    step = sharded.save(
        tmp_path / "ckpt",
        3,
        build_model(cfg, single_process_mesh()),
        WeightsOnly(),
        single_process_mesh(),
        {"config": dataclasses.asdict(cfg)},
    )
    args = (str(step), str(tmp_path / "tokenizer.model"), TASKS, TASK)
    [one] = pool.run(score_local_task, 1, TINY, *args)
    layouts = {
        "tp2": (["parallel.tp=2", "parallel.sp=true"], {"tp": 2}),
        "pp2": (["parallel.pp=2"], {"pp": 2}),
        "dp2": ([], {}),
    }
    for name, (over, axes) in layouts.items():
        for rank, got in enumerate(pool.run(score_local_task, 2, TINY + over, *args, **axes)):
            assert got["acc"] == one["acc"], (name, rank)
            assert worst_gap(got["ll"], one["ll"]) <= 1e-6, (name, rank, got["ll"][:2], one["ll"][:2])
