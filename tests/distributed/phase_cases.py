"""What the rank pool runs for the per-phase memory test: the peak of start-up, the first step, a save and
the load of that save on this rank, measured by the trainer's own meter (training/phases.py)."""
from __future__ import annotations

import gc
from pathlib import Path

from megaframe.checkpoint import sharded
from megaframe.data.dataset import build_data, microbatches
from megaframe.model.gpt import build_model
from megaframe.optim.build import build_optimizer, cast_model
from megaframe.training.phases import PhaseMeter
from megaframe.training.save_guard import state_is_finite
from megaframe.training.step import train_step
from tests.distributed.cases import tiny_config


def _build(cfg, mesh):
    model = cast_model(build_model(cfg, mesh), cfg.train.precision)
    return model, build_optimizer(model, cfg.optim, mesh)


def measure_phases(mesh, overrides: list[str], folder: str) -> dict:
    """This rank's (pp, tp) coordinate and its four phase peaks, as the trainer would log them."""
    cfg = tiny_config(overrides + ["train.max_steps=1"], mesh.world)
    t = cfg.train
    meter = PhaseMeter(mesh.device)
    meter.begin("startup")
    model, optimizer = _build(cfg, mesh)
    meter.end()
    meter.track(model, optimizer)
    batches = microbatches(build_data(cfg), 0, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size,
                           t.seed, cp_rank=mesh.cp.rank, cp_size=mesh.cp.size)
    with meter.phase("step"):
        train_step(model, optimizer, batches, mesh, cfg, 1)
    del batches
    with meter.phase("save"):  # what the trainer's save does (training/checkpointing.py)
        optimizer.settle()
        state_is_finite(model, optimizer, mesh)
        path = sharded.save(folder, 1, model, optimizer, mesh, {"step_meta": 1})
    del model, optimizer
    gc.collect()
    model, optimizer = _build(cfg, mesh)
    meter.track(model, optimizer)
    with meter.phase("load"):
        sharded.load_into(Path(path), model, optimizer)
    return {"pp_rank": mesh.pp.rank, "tp_rank": mesh.tp.rank, **meter.figures}
