"""Pool functions for the generation test: train a few steps under a layout and save a checkpoint."""

from __future__ import annotations

import dataclasses

from megaframe.checkpoint import sharded
from megaframe.inference.sampler import greedy
from megaframe.optim.build import build_optimizer
from tests.distributed.cases import tiny_config
from tests.forms import build_data, build_model, microbatches, train_step


def train_and_save(
    mesh, overrides: list[str], steps: int, root: str, prompt: list[int]
) -> tuple[str, list[int]]:
    """`steps` optimizer steps, then a committed checkpoint under root (collective); returns its path and
    the training-time sampler's greedy continuation of `prompt` under this layout."""
    cfg = tiny_config(overrides + [f"train.max_steps={steps}"], mesh.world)
    model = build_model(cfg, mesh)
    optimizer = build_optimizer(model, cfg.optim, mesh)
    data, t = build_data(cfg), cfg.train
    for step in range(1, steps + 1):
        batches = microbatches(
            data, step - 1, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size, t.seed
        )
        train_step(model, optimizer, batches, mesh, cfg, step)
    meta = {"consumed_samples": steps * t.global_batch_size, "config": dataclasses.asdict(cfg)}
    path = str(sharded.save(root, steps, model, optimizer, mesh, meta))
    return path, greedy(model.eval(), mesh, prompt, 12, cfg.model.vocab_size)
