"""Run lm-eval tasks on a megaframe LM and flatten the scores to {task: {metric: value}}.

Hub tasks download their datasets; a hub that cannot be reached is one ValueError line naming the task
(exit 2 at the command line, one logged line in the training loop), not a traceback. Local tasks come
from `include_path` (a folder of task YAMLs, e.g. tests/data/lm_eval_tasks).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from megaframe.config.rules import FIELD_RULES, NONNEG, PART, POS, Either, Rule, check_options

STDERR = "_stderr"

OPTION_RULES = {
    # the training loop's train.downstream_batch_size rule: a batch of 0 divided by zero, a negative one
    # left requests unscored at log-likelihood 0 (probability 1) and returned better scores with exit 0
    "batch_size": FIELD_RULES["train.downstream_batch_size"],
    # lm-eval's limit: below 1 a fraction of each task's documents, from 1 on a count of them
    "limit": Either((PART, POS)),
    "num_fewshot": NONNEG,
    # the model's context in tokens (default: its model.seq_length)
    "max_length": Rule(1, optional=True, integer=True),
}
"""The numeric lm-eval options every megaframe entry point takes (evaluate's +batch_size=..., the lm-eval
command line's --batch_size ..., the model's batch_size=...): one table, config/rules.py's rules."""


def check_task_options(opts: dict, shown) -> dict:
    """`opts` with its numbers parsed and range-checked (OPTION_RULES) and its include_path an existing
    folder; ConfigError names the option as `shown(key, value)` writes it."""
    opts = check_options(opts, OPTION_RULES, shown)
    path = opts.get("include_path")
    if path and not Path(path).is_dir():  # lm-eval skips a missing folder and then knows no task
        raise ValueError(f"{shown('include_path', path)}: no such folder")
    return opts


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def task_list(tasks) -> list[str]:
    """hellaswag,arc_easy | [hellaswag, arc_easy] -> names."""
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    return [t.strip() for t in tasks or [] if str(t).strip()]


def task_manager(names: list[str], include_path: str | None = None):
    """lm-eval's TaskManager that knows `names`. Indexing lm-eval's own ~14,000 task YAMLs takes 10 s to
    over a minute of CPU, per process and (uncached) per call: the training loop scores each task at each
    due step. So a folder that holds every named task is indexed alone, and for a name the folder lacks
    (a hub task) only the built-in YAMLs that can define it (evaluation/task_subset.py), once per process."""
    if include_path:
        local = _indexed(str(include_path))
        if all(n in local.all_tasks for n in names):
            return local
    return _with_builtins(tuple(sorted(set(names))), str(include_path) if include_path else None)


@functools.lru_cache(maxsize=8)
def _indexed(include_path: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=False)


@functools.lru_cache(maxsize=8)
def _with_builtins(names: tuple[str, ...], include_path: str | None):
    import lm_eval.tasks

    from megaframe.evaluation.task_subset import subset_manager

    return subset_manager(list(names), Path(lm_eval.tasks.__file__).parent, include_path)


def run_tasks(
    lm,
    tasks,
    include_path: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """Scores of each task (ValueError on an unknown task or one whose data cannot be loaded)."""
    import logging

    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices would bury the scores
    names = task_list(tasks)
    if not names:
        raise ValueError("no lm-eval tasks given (+tasks=hellaswag,arc_easy)")
    if include_path and not Path(include_path).is_dir():  # the loop's train.downstream_include_path too
        raise ValueError(f"include_path={include_path}: no such folder")
    manager = task_manager(names, include_path)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        where = f" (include_path={include_path})" if include_path else ""
        raise ValueError(f"unknown lm-eval task(s) {','.join(unknown)}{where}: `lm_eval ls tasks` lists them")
    # lm-eval returns the scores only where LOCAL_RANK is 0 (its own multi-GPU runs); the megaframe model
    # hands every rank every result, and the rank that logs (the last pipeline stage's) may be any of them
    local_rank = os.environ.pop("LOCAL_RANK", None)
    try:
        # no seeding of python/numpy/torch: in the training loop that would reset the run's RNG streams
        out = simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            bootstrap_iters=0,
            random_seed=None,
            numpy_random_seed=None,
            torch_random_seed=None,
            verbosity="ERROR",
        )
    except (OSError, ConnectionError) as e:  # requests/httpx/hub errors are OSErrors
        raise ValueError(
            f"task(s) {','.join(names)}: cannot load the dataset ({_one_line(e)}); is the "
            "Hugging Face hub reachable (HF_HUB_OFFLINE, proxy)?"
        ) from None
    except Exception as e:  # datasets' own exceptions (DatasetNotFoundError ...) do not share a base
        if "datasets" in type(e).__module__ or "huggingface_hub" in type(e).__module__:
            raise ValueError(f"task(s) {','.join(names)}: cannot load the dataset ({_one_line(e)})") from None
        raise
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    return flatten(out["results"])


def flatten(results: dict) -> dict[str, dict[str, float]]:
    """{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...} -> {"acc": 0.5} per task; a filter other
    than `none` stays in the name (exact_match_strict-match)."""
    scores = {}
    for task, row in results.items():
        mine = {}
        for key, value in row.items():
            if "," not in key or STDERR in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            mine[metric if filt == "none" else f"{metric}_{filt}"] = float(value)
        scores[task] = mine
    return scores


def format_scores(scores: dict[str, dict[str, float]]) -> str:
    return " | ".join(
        f"{task} " + " ".join(f"{m} {v:.4f}" for m, v in sorted(row.items()))
        for task, row in sorted(scores.items())
    )
