"""Downstream tasks during training (train.downstream_interval): lm-eval on the live model, in the run's
layout.

Every rank scores (each dp replica its share of the requests, evaluation/scoring.py); the logging rank prints
one line and the trainer adds downstream/<task>/<metric> to the step's metrics row (metrics.jsonl, wandb).
A task that fails (its data unreachable, a broken task file, anything it raises) logs one line and training
goes on: a downstream score is a report on the run, never a reason to end it. The tasks fail alike on
every rank (the same files, the same requests), so no rank is left alone in a collective.
"""

from __future__ import annotations

import sys
import time

from megaframe.config.schema import DataConfig, TrainConfig


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300]


class Downstream:
    """Built once per run; `score(step, model)`: {downstream/<task>/<metric>: value} and the seconds taken."""

    def __init__(self, t: TrainConfig, mesh, tokenizer):
        from megaframe.evaluation.lm_tasks import task_list

        self.t, self.mesh, self.tok = t, mesh, tokenizer
        self.tasks = task_list(t.downstream_tasks)

    @classmethod
    def build(cls, t: TrainConfig, d: DataConfig, mesh) -> "Downstream | None":
        """None unless train.downstream_interval > 0, lm-eval is installed and the data group `d` names a
        tokenizer (each missing piece is one warning)."""
        from megaframe.data.tokenizer import load_tokenizer
        from megaframe.inference.files import tokenizer_record

        if t.downstream_interval <= 0:
            return None
        why = None
        try:
            import lm_eval  # noqa: F401  the optional extra
        except ImportError:
            why = "lm-eval is not installed (pip install -e '.[eval]')"
        rec = tokenizer_record(d)
        if why is None and rec is None:
            why = "no tokenizer (synthetic data?)"
        if why is not None:
            if mesh.is_logger:
                print(
                    f"megaframe: warning: train.downstream_interval: {why}; no downstream scores",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        return cls(t, mesh, load_tokenizer(rec["path"]))

    def due(self, step: int) -> bool:
        return step % self.t.downstream_interval == 0 or step == self.t.max_steps

    def score(self, step: int, model) -> tuple[dict[str, float], float]:
        from megaframe.evaluation.lm_eval_adapter import MegaframeLM
        from megaframe.evaluation.lm_tasks import format_scores, run_tasks

        t0, t = time.perf_counter(), self.t
        was_training = model.training
        model.eval()
        counted = self.mesh.stats.pop()  # keep scoring traffic out of the step's comm_bytes
        row, scores = {}, {}
        try:
            lm = MegaframeLM.live(model, self.mesh, self.tok, t.downstream_batch_size)
            for task in self.tasks:  # one at a time: a failing task costs only its own scores
                try:
                    got = run_tasks(lm, [task], t.downstream_include_path or None, t.downstream_limit or None)
                except Exception as e:  # noqa: BLE001  never end the run for a report on it
                    if self.mesh.is_logger:
                        print(
                            f"megaframe: warning: downstream task {task} at step {step} failed "
                            f"({_one_line(e)}); training goes on",
                            file=sys.stderr,
                            flush=True,
                        )
                    continue
                scores.update(got)
        finally:
            model.train(was_training)
            self.mesh.stats.pop()
            for group, nbytes in counted.items():
                self.mesh.stats.add(group, nbytes)
        for task, metrics in scores.items():
            row.update({f"downstream/{task}/{m}": v for m, v in metrics.items()})
        seconds = time.perf_counter() - t0
        if scores and self.mesh.is_logger:
            print(f"downstream step {step}: {format_scores(scores)} ({seconds:.1f}s)", flush=True)
        return row, seconds
