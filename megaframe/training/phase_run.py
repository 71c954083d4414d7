"""One rank's four phase peaks (start-up, the first step, a save, the load of that save), measured by the
trainer's own meter (training/phase_meter.py) around what the trainer does in each phase: build the model and
optimizer; one train_step; settle, the finiteness vote and a blocking save (training/checkpointing.py);
a fresh model and optimizer loaded from that save. The planner's per-phase figures (planning/phases.py) are
checked against it (tests/distributed/test_plan_phases.py, benchmarks/mem_phases.py)."""

from __future__ import annotations

import gc
from pathlib import Path

from megaframe.checkpoint import sharded
from megaframe.data.dataset import microbatches
from megaframe.model.parallelize import build
from megaframe.training.phase_meter import PhaseMeter
from megaframe.training.save_guard import state_is_finite
from megaframe.training.startup import run_samples
from megaframe.training.step import train_step


def measure_phases(mesh, cfg, folder: str) -> dict:
    """This rank's (pp, tp) coordinate and its four phase peaks in bytes, as the trainer would log them."""
    t = cfg.train
    meter = PhaseMeter(mesh.device)
    meter.begin("startup")
    model, optimizer = build(cfg, mesh)
    meter.end()
    meter.track(model, optimizer)
    batches = microbatches(
        run_samples(cfg),
        0,
        t.global_batch_size,
        t.micro_batch_size,
        mesh.dp.rank,
        mesh.dp.size,
        t.seed,
        cp_rank=mesh.cp.rank,
        cp_size=mesh.cp.size,
    )
    with meter.phase("step"):
        train_step(model, optimizer, batches, mesh, cfg, 1)
    del batches
    with meter.phase("save"):
        optimizer.settle()
        state_is_finite(model, optimizer, mesh)
        path = sharded.save(folder, 1, model, optimizer, mesh, {"step_meta": 1})
    del model, optimizer
    gc.collect()
    model, optimizer = build(cfg, mesh)
    meter.track(model, optimizer)
    with meter.phase("load"):
        sharded.load_into(Path(path), model, optimizer)
    return {"pp_rank": mesh.pp.rank, "tp_rank": mesh.tp.rank, **meter.figures}
