"""Work between two steps under the hang watchdog, in one process with a watchdog that records its trip
instead of ending the process: validation, sampling and downstream scoring that take longer than the hang
limit (each forward slowed by a sleep) are progress, one batch at a time, so the watchdog never trips."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from megaframe.config.schema import TrainConfig
from megaframe.inference.sampler import Sampler
from megaframe.parallel.mesh import single_process_mesh
from megaframe.runops.guard import RunGuard
from megaframe.runops.signals import StopFlag
from megaframe.runops.watchdog import Watchdog
from megaframe.training import trainer
from megaframe.training.validation import Evaluator
from tests.distributed.cases import tiny_config
from tests.forms import build, build_data

LIMIT_S, FORWARD_S = 1.0, 0.15
"""The hang limit, and each forward's sleep: a batch is well inside the limit, the whole work beyond it."""


class Chars:
    """A tokenizer of characters (ids 3..), enough for samples and lm-eval's requests."""

    vocab_size, eos_id = 128, 2

    def encode(self, texts, num_threads=None):
        return [[3 + ord(c) % 120 for c in t] for t in texts]

    def decode(self, ids):
        return "".join(chr(97 + (i - 3) % 26) for i in ids if i >= 3)


@pytest.fixture()
def slowed(tmp_path):
    """(config, mesh, model whose every forward sleeps FORWARD_S, guard with a recording watchdog, trips)."""
    cfg = tiny_config(["train.global_batch_size=4", "train.micro_batch_size=2", "data.valid_fraction=0.5"], 1)
    mesh = single_process_mesh("cpu")
    model, _ = build(cfg, mesh)
    # the embedding: every forward (validation, a sampled token, a scored batch) runs it once
    embedding = next(m for name, m in model.named_modules() if name == "embed")
    embedding.register_forward_pre_hook(lambda *_: time.sleep(FORWARD_S))
    stop = StopFlag()
    guard = RunGuard(cfg.train, mesh, stop, str(tmp_path), "t")
    trips: list = []
    guard.watchdog = Watchdog(LIMIT_S, 0, str(tmp_path), mesh.stats, exit_fn=trips.append, grace_s=0).start()
    guard.watchdog.beat(2)
    try:
        yield cfg, mesh, model, guard, trips
    finally:
        guard.close()


def test_validation_and_sampling_longer_than_the_hang_limit_are_progress(slowed, tmp_path):
    cfg, mesh, model, guard, trips = slowed
    t: TrainConfig = dataclasses.replace(
        cfg.train, eval_interval=2, eval_iters=8, sample_interval=2, sample_tokens=12, sample_prompts=["ab"]
    )
    evaluator = Evaluator(t, mesh, build_data(cfg, "valid"), cfg.model.seq_length)
    su = SimpleNamespace(evaluator=evaluator, sampler=Sampler(t, mesh, Chars()), model=model)
    paused: list = []
    meter = SimpleNamespace(paused=paused.append)
    val, sampled = trainer.evaluate_and_sample(
        su, meter, SimpleNamespace(wandb_run=None), 2, str(tmp_path), guard
    )
    assert val is not None and sampled
    assert paused[0] > 2 * LIMIT_S and paused[1] > LIMIT_S  # each longer than the limit, as it meant to be
    assert trips == [] and guard.watchdog.doing is None


def test_downstream_scoring_longer_than_the_hang_limit_is_progress(slowed, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")
    from megaframe.evaluation.downstream import Downstream
    from tests.unit.evaluation.test_lm_eval import TASKS

    cfg, mesh, model, guard, trips = slowed
    t = dataclasses.replace(
        cfg.train,
        downstream_interval=2,
        downstream_tasks=["megaframe_tiny_mc"],
        downstream_include_path=TASKS,
        downstream_limit=2,
        downstream_batch_size=1,
    )
    su = SimpleNamespace(downstream=Downstream(t, mesh, Chars()), model=model)
    paused: list = []
    row, scored = trainer.downstream_scores(su, SimpleNamespace(paused=paused.append), 2, guard)
    assert scored and "downstream/megaframe_tiny_mc/acc" in row, row
    assert paused[0] > LIMIT_S and trips == []
