"""One optimizer step: this rank's pipeline schedule over its micro-batches, then the optimizer's step
(gradient reductions, the tied embedding's included; clipping; AdamW). Returns device tensors; nothing
here syncs the host.

Each micro-batch's loss is its token-loss sum divided by the global batch's token count, so the
gradients summed over micro-batches and dp ranks are exactly those of the mean loss of the global
batch, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.config.derived import Derived
from megaframe.config.schema import OptimConfig
from megaframe.model import mtp
from megaframe.model.moe import stats as moe_stats
from megaframe.optim.lr_schedule import lr_at
from megaframe.parallel.mesh import Mesh
from megaframe.parallel.observe import named
from megaframe.pipeline.executor import run_schedule
from megaframe.pipeline.grouping import build_schedule
from megaframe.pipeline.schedule import SCHEDULES, paired_forwards


@dataclass
class StepResult:
    loss_sum: torch.Tensor
    """Sum of token losses over this rank's micro-batches (not yet reduced over dp)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    lr: float


def optimizer_step(
    model, optimizer, batches, mesh: Mesh, o: OptimConfig, derived: Derived, step: int, probe=None
) -> StepResult:
    """Run optimizer step number `step` (1-based) on `batches`, this rank's micro-batches, with the optim
    group `o` and the run's derived record (the loss divisor, the schedule, the LR horizon).

    `probe` (a training.straggler.StragglerProbe) opens the compute window and collects the
    executor's forward/backward timings, before any data-parallel or optimizer collective."""
    d = derived
    # the loss divisor is the global token count on every rank: dp and micro-batch sums then give the mean's
    # gradient
    tokens_global = d.tokens_per_step
    optimizer.zero_grad()
    moe_stats.begin_step(model)
    mtp.begin_step(model)
    if probe is not None:
        probe.begin(step)
    # the schedule the model was built for (its stage holds vpp chunks, placed in a loop or a V)
    kind = model.schedule or d.pp_schedule
    shape = (kind, mesh.pp.size, len(model.stage.chunks), len(batches), mesh.pp.rank)
    schedule = build_schedule(*shape)
    loss_sum = run_schedule(
        schedule,
        model,
        batches,
        mesh,
        optimizer,
        tokens_global,
        timeline=probe.spans if probe is not None else None,
        paired=paired_forwards(*shape) if SCHEDULES[kind].overlap else None,
    )
    # a Python float from the step alone: no device tensor, no sync, the same on every rank
    lr = lr_at(step, o.lr, o.min_lr, o.warmup_steps, d.lr_horizon, o.lr_schedule, o.wsd_decay_fraction)
    with named(mesh.stats, "optimizer_step"):  # a profiler range while profiled (train.profile_steps)
        norm = optimizer.step(lr)
    # once per optimizer step, from the expert loads this
    # step's micro-batches recorded (begin_step reset them)
    moe_stats.update_expert_bias(model, mesh)  # no-op unless model.moe_expert_bias
    return StepResult(loss_sum, norm, lr)
