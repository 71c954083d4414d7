"""Downstream tasks during training (train.downstream_interval): lm-eval on the live model, in the run's
layout.

Every rank scores (each dp replica its share of the requests, evaluation/scoring.py); the logging rank prints
one line and the trainer adds downstream/<task>/<metric> to the step's metrics row (metrics.jsonl, wandb).
A task that fails (its data unreachable, a broken task file, anything it raises) logs one line and training
goes on: a downstream score is a report on the run, never a reason to end it.

A task may fail on one rank only (a dataset one node cannot fetch). So each task is agreed over every rank
before its first collective (`TaskGate`: at the model's first scoring call, or once the task failed
before it): all of them score it or all skip it, and the logging rank names the failed ranks and their
reasons. After scoring they agree again, so all log the task's scores or none does. A stop signal on any
rank skips the remaining tasks at the next agreement: the stop's save waits for no report.

Collectives run only inside the model's scoring calls: there the hang watchdog (runops/watchdog.py) hears
every scored batch and judges by train.hang_timeout_s. lm-eval's own work around them (its task index, a
dataset's download, building requests, metrics) has no batches and cannot hang a collective, so it runs
under train.downstream_harness_timeout_s instead.
"""

from __future__ import annotations

import contextlib
import sys
import time

from megaframe.config.schema import DataConfig, TrainConfig
from megaframe.parallel import agreement, comm


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300]


class Skipped(ValueError):
    """Raised out of the model's scoring call when the agreement says skip (lm-eval lets it through); a
    ValueError: a command line ends with its one line, exit 2."""


class TaskGate:
    """One task's agreement over every rank of the job, once, before its first collective: (this rank's
    error or None, whether this rank has a stop signal) gathered; `failed` and `stopping` the same on every
    rank afterwards."""

    def __init__(self, mesh, signalled):
        self.mesh, self.signalled = mesh, signalled
        self.agreed = False
        self.failed: dict[int, str] = {}
        self.stopping = False

    def agree(self, error: str | None = None) -> bool:
        """Whether every rank may score; the first call only gathers (later ones return the answer)."""
        if not self.agreed:
            self.agreed = True
            every = comm.gather_objects((error, self.signalled()), self.mesh.group)
            self.failed = {r: e for r, (e, _) in enumerate(every) if e is not None}
            self.stopping = any(s for _, s in every)
        return not (self.failed or self.stopping)

    def reason(self) -> str:
        if not self.failed:
            return "a stop signal arrived"
        return f"failed on {agreement.named_failures(self.failed, max(self.mesh.world, 2))}"


@contextlib.contextmanager
def scoring_window(gate: TaskGate, watchdog, harness_s: float):
    """Around each of the model's scoring calls: skip (raise) unless every rank may score; inside, each
    batch beats the watchdog under train.hang_timeout_s; after, lm-eval's own work has `harness_s` again."""
    if not gate.agree():
        raise Skipped(gate.reason())
    if watchdog is None:
        yield
        return
    watchdog.allow(None)
    try:
        yield
    finally:
        watchdog.allow(harness_s)


class Downstream:
    """Built once per run; `score(step, model)`: {downstream/<task>/<metric>: value} and the seconds taken."""

    def __init__(self, t: TrainConfig, mesh, tokenizer):
        from megaframe.evaluation.lm_tasks import task_list

        self.t, self.mesh, self.tok = t, mesh, tokenizer
        self.tasks = task_list(t.downstream_tasks)

    @classmethod
    def build(cls, t: TrainConfig, d: DataConfig, mesh) -> "Downstream | None":
        """None unless train.downstream_interval > 0, lm-eval is installed and the data group `d` names a
        tokenizer, on every rank: a piece missing on one node only (lm-eval not installed there) is agreed
        over the job (collective), so every rank scores or none does; each missing piece is one warning."""
        from megaframe.data.tokenizer import load_tokenizer
        from megaframe.inference.files import tokenizer_record

        if t.downstream_interval <= 0:
            return None
        why, built = None, None
        try:
            import lm_eval  # noqa: F401  the optional extra
        except ImportError:
            why = "lm-eval is not installed (pip install -e '.[eval]')"
        rec = tokenizer_record(d)
        if why is None and rec is None:
            why = "no tokenizer (synthetic data?)"
        if why is None:
            try:
                built = cls(t, mesh, load_tokenizer(rec["path"]))
            except (OSError, ValueError, RuntimeError) as e:
                why = f"cannot load the tokenizer ({_one_line(e)})"
        failed = agreement.agree(why, mesh.group)
        if failed:
            if mesh.is_logger:
                why = agreement.named_failures(failed, mesh.world)
                print(
                    f"megaframe: warning: train.downstream_interval: {why}; no downstream scores",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        return built

    def due(self, step: int) -> bool:
        return step % self.t.downstream_interval == 0 or step == self.t.max_steps

    def score(
        self, step: int, model, watchdog=None, signalled=lambda: False
    ) -> tuple[dict[str, float], float]:
        """Every task, each agreed over the ranks; `watchdog` hears each scored batch, `signalled()` says
        whether this rank has a stop signal (the remaining tasks are then skipped on every rank)."""
        from megaframe.evaluation.lm_eval_adapter import MegaframeLM
        from megaframe.evaluation.lm_tasks import format_scores

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        counted = self.mesh.stats.pop()  # keep scoring traffic out of the step's comm_bytes
        row, scores = {}, {}
        try:
            lm = MegaframeLM.live(model, self.mesh, self.tok, self.t.downstream_batch_size)
            lm.beat = watchdog.beat if watchdog is not None else None
            for k, task in enumerate(self.tasks):  # one at a time: a failing task costs only its own scores
                got, stop = self._task(lm, task, step, watchdog, signalled)
                scores.update(got)
                if stop:
                    self._say(f"a stop signal arrived: downstream task(s) {','.join(self.tasks[k:])} skipped")
                    break
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

    def _task(self, lm, task: str, step: int, watchdog, signalled) -> tuple[dict, bool]:
        """({task: scores} or {}, whether a stop signal ends the scoring); collective on every rank."""
        from megaframe.evaluation.lm_tasks import run_tasks

        t = self.t
        # lm-eval's own work has no batches to beat by: its allowance outside the model's scoring calls
        phase = (
            watchdog.phase(f"downstream task {task} at step {step}", t.downstream_harness_timeout_s)
            if watchdog is not None
            else contextlib.nullcontext()
        )
        gate = TaskGate(self.mesh, signalled)
        lm.scoring = lambda: scoring_window(gate, watchdog, t.downstream_harness_timeout_s)
        error, got = None, {}
        with phase:
            try:
                got = run_tasks(lm, [task], t.downstream_include_path or None, t.downstream_limit or None)
            except Skipped:
                pass
            except Exception as e:  # noqa: BLE001  never end the run for a report on it
                error = _one_line(e)
            finally:
                lm.scoring = None
            if not gate.agreed:  # it failed (or had nothing to score) before the model was called
                gate.agree(error)
            elif not (gate.failed or gate.stopping):  # scored on every rank: all log it, or none does
                gate.failed = agreement.agree(error, self.mesh.group)
        if gate.failed:
            why = agreement.named_failures(gate.failed, self.mesh.world)
            self._say(f"downstream task {task} at step {step} failed ({why}); training goes on")
            return {}, gate.stopping
        return ({} if gate.stopping else got), gate.stopping

    def _say(self, text: str) -> None:
        if self.mesh.is_logger:
            print(f"megaframe: warning: {text}", file=sys.stderr, flush=True)
