"""Components built from their config group and the derived record (config/derived.py) run as the
run-config forms kept for callers outside the package do: the same samples, the same step, and an
evaluator that reads only the train group (its validation data read only when evaluation is on)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megaframe.config.derived import derive
from megaframe.data.kinds import build_samples
from megaframe.model.parallelize import build_for
from megaframe.parallel.mesh import single_process_mesh
from megaframe.training.step import optimizer_step
from megaframe.training.validation import Evaluator
from tests.distributed.cases import tiny_config
from tests.forms import build, build_data, microbatches, train_step

BATCH = ["train.global_batch_size=4", "train.micro_batch_size=2"]


@pytest.mark.parametrize("data", ["synthetic", "demo"])
@pytest.mark.parametrize("split", ["train", "valid"])
def test_samples_from_the_data_group_are_the_run_configs(data, split, request):
    if data == "demo":  # the corpus a fresh clone prepares once (it passed only after a test that had)
        request.getfixturevalue("demo_prepared")
    cfg = tiny_config([f"data={data}", *BATCH], 1)
    m, t = cfg.model, cfg.train
    ours = build_samples(cfg.data, m.seq_length, m.vocab_size, t.seed, t.global_batch_size, split)
    theirs = build_data(cfg, split)
    for step in range(3):
        a, b = (microbatches(d, step, 4, 2, 0, 1, t.seed) for d in (ours, theirs))
        assert all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)), step


def test_a_step_from_the_groups_is_the_run_configs_step():
    cfg = tiny_config(BATCH, 1)
    mesh = single_process_mesh("cpu")
    batches = microbatches(build_data(cfg), 0, 4, 2, 0, 1, cfg.train.seed)
    a, opt_a = build(cfg, mesh)
    b, opt_b = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    for step in (1, 2):
        ra = train_step(a, opt_a, batches, mesh, cfg, step)
        rb = optimizer_step(b, opt_b, batches, mesh, cfg.optim, derive(cfg, mesh.world), step)
        assert (ra.loss_sum.item(), ra.grad_norm.item(), ra.lr) == (
            rb.loss_sum.item(),
            rb.grad_norm.item(),
            rb.lr,
        )
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_the_evaluator_reads_the_train_group_and_its_data_only_when_on():
    cfg = tiny_config([*BATCH, "train.eval_iters=2", "train.max_steps=10"], 1)
    mesh = single_process_mesh("cpu")

    def unreadable():
        raise AssertionError("validation data read with evaluation off")

    off = dataclasses.replace(cfg.train, eval_interval=0)
    assert Evaluator.build(off, mesh, unreadable, cfg.model.seq_length) is None
    on = dataclasses.replace(cfg.train, eval_interval=3)
    ev = Evaluator.build(on, mesh, lambda: build_data(cfg, "valid"), cfg.model.seq_length)
    assert [s for s in range(1, 11) if ev.due(s)] == [3, 6, 9, 10]
    model, _ = build(cfg, mesh)
    loss = ev.evaluate(model)
    # a fresh model scores about ln(vocab) per token: the token count divides the summed loss once
    assert abs(loss - torch.log(torch.tensor(float(cfg.model.vocab_size))).item()) < 1.0
