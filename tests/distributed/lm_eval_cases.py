"""Pool functions for the lm-eval layout test: a checkpoint loaded into a layout scores the local task."""

from __future__ import annotations

from megaframe.checkpoint import sharded
from megaframe.config import load_config
from megaframe.data.tokenizer import load_tokenizer
from tests.forms import build_model


def score_local_task(mesh, overrides: list[str], step: str, tokenizer: str, tasks: str, task: str) -> dict:
    """Every choice's log-likelihood of `task` and its accuracy, scored by the `megaframe` lm-eval model on
    the live model of this layout (every rank calls; each returns what lm-eval reported to it)."""
    from lm_eval import simple_evaluate

    from megaframe.evaluation.lm_eval_adapter import MegaframeLM
    from megaframe.evaluation.lm_tasks import task_manager

    cfg = load_config(overrides, world_size=mesh.world, check_data=False)
    model = build_model(cfg, mesh)
    sharded.load_into(step, model)
    lm = MegaframeLM.live(model.eval(), mesh, load_tokenizer(tokenizer), batch_size=3)
    out = simple_evaluate(
        model=lm, tasks=[task], task_manager=task_manager([task], tasks), log_samples=True, bootstrap_iters=0
    )
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return {
        "ll": [[float(r[0]) for r in s["filtered_resps"]] for s in samples],
        "acc": out["results"][task]["acc,none"],
    }
