"""One rank's four phase peaks (start-up, the first step, a save, the load of that save), measured by the
trainer's own meter (training/phase_meter.py) around what the trainer does in each phase: build the model and
optimizer; one train_step; settle, the finiteness vote and a blocking save (training/checkpointing.py);
a fresh model and optimizer loaded from that save. The planner's per-phase figures (memory/phases.py) are
checked against it (tests/distributed/planning/test_plan_phases.py, benchmarks/mem_phases.py)."""

from __future__ import annotations

import gc
from pathlib import Path

from megaframe.checkpoint import sharded
from megaframe.config.derived import derive
from megaframe.data.dataset import BatchShape, microbatches
from megaframe.model.parallelize import build_for
from megaframe.training.phase_meter import PhaseMeter
from megaframe.training.save_guard import state_is_finite
from megaframe.training.startup import run_samples
from megaframe.training.step import optimizer_step


def measure_phases(mesh, cfg, folder: str) -> dict:
    """This rank's (pp, tp) coordinate and its four phase peaks in bytes, as the trainer would log them."""
    t = cfg.train
    meter = PhaseMeter(mesh.device)
    meter.begin("startup")
    model, optimizer = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    meter.end()
    meter.track(model, optimizer)
    shape = BatchShape(t.global_batch_size, t.micro_batch_size, t.seed)
    batches = microbatches(run_samples(cfg), 0, shape, mesh)
    with meter.phase("step"):
        optimizer_step(model, optimizer, batches, mesh, cfg.optim, derive(cfg, mesh.world), 1)
    del batches
    with meter.phase("save"):
        optimizer.settle()
        state_is_finite(model, optimizer, mesh)
        path = sharded.save(folder, 1, model, optimizer, mesh, {"step_meta": 1})
    del model, optimizer
    gc.collect()
    model, optimizer = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    meter.track(model, optimizer)
    with meter.phase("load"):
        sharded.load_into(Path(path), model, optimizer)
    return {"pp_rank": mesh.pp.rank, "tp_rank": mesh.tp.rank, **meter.figures}
