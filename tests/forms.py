"""The whole-config and positional forms of the typed entry points, for tests, benchmarks and dev scripts:
they hold a whole loaded config (and explicit ranks) where the package's components take their own groups
and the mesh (docs/architecture.md, "The config")."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megaframe.config.derived import derive
from megaframe.data import dataset
from megaframe.model.parallelize import build_for, build_model_for
from megaframe.training.startup import run_samples
from megaframe.training.step import optimizer_step


def build(cfg, mesh):
    """This rank's model and optimizer for the run config `cfg` (model/parallelize.py: build_for)."""
    return build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)


def build_model(cfg, mesh):
    """This rank's model for the run config `cfg` (model/parallelize.py: build_model_for)."""
    return build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)


def build_data(cfg, split: str = "train"):
    """The run's samples of `split` (data/kinds.py: build_samples on the config's groups)."""
    return run_samples(cfg, split)


def train_step(model, optimizer, batches, mesh, cfg, step: int, probe=None, derived=None):
    """optimizer_step for the run config `cfg`; `derived`: the run's record, else derived here."""
    return optimizer_step(
        model, optimizer, batches, mesh, cfg.optim, derived or derive(cfg, mesh.world), step, probe
    )


def microbatches(
    data,
    step: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    device="cpu",
    base: int = 0,
    cp_rank: int = 0,
    cp_size: int = 1,
):
    """data/dataset.py: microbatches for a reader at explicit (dp, cp) coordinates, without a mesh."""
    reader = SimpleNamespace(
        dp=SimpleNamespace(rank=dp_rank, size=dp_size),
        cp=SimpleNamespace(rank=cp_rank, size=cp_size),
        device=torch.device(device),
    )
    shape = dataset.BatchShape(global_batch, micro_batch, seed, base)
    return dataset.microbatches(data, step, shape, reader)
