"""Functions the rank pool runs for the pipeline tests: fn(mesh, *args), module-level for spawned workers."""

from __future__ import annotations

import torch

from megaframe.parallel import comm
from megaframe.pipeline import p2p
from tests.distributed.cases import job_config, train_and_report
from tests.forms import build_data, build_model, microbatches


def emulates_nccl(mesh) -> bool:
    """Whether this rank's pipeline axis runs NCCL's p2p rules (the suite's mode)."""
    return mesh.pp.p2p is not None


def val_loss(mesh, overrides: list[str]) -> float | None:
    """evaluate.loss_sum (a forward-only schedule through the executor) of step 0's batches on the fresh
    model, as the mean token loss; rank 0 returns it."""
    from megaframe.training.validation import loss_sum

    cfg = job_config(mesh, overrides)
    model, data, t = build_model(cfg, mesh), build_data(cfg), cfg.train
    model.eval()
    batches = microbatches(
        data, 0, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size, t.seed
    )
    with torch.no_grad():
        total = comm.all_reduce(loss_sum(model, batches, mesh), mesh.dp)
    comm.all_reduce(total, mesh.pp)  # only the last stage has a loss
    return total.item() / (t.global_batch_size * cfg.model.seq_length) if mesh.rank == 0 else None


class _OldTransfer(p2p.Transfer):
    """The wait before the fix: on the Works after the first len(sends), as if there were one per op.
    On NCCL (one coalesced Work per batch) that waits on nothing when the batch also sends."""

    def __init__(self, works: list, sends: int):
        super().__init__(works)
        self.sends = sends

    def wait(self) -> None:
        for w in self.works[self.sends :]:
            w.wait()


def old_start(pp, sends, recvs) -> p2p.Transfer:
    return _OldTransfer(comm.batch_isend_irecv(pp, sends, recvs), len(sends))


def train_with_old_exchange(mesh, overrides: list[str], steps: int) -> dict | None:
    """train_and_report with the pre-fix wait patched in on this rank (restored afterwards)."""
    fixed = p2p.start
    p2p.start = old_start
    try:
        return train_and_report(mesh, overrides, steps)
    finally:
        p2p.start = fixed


def train_with_old_grouping(mesh, overrides: list[str], steps: int) -> dict | None:
    """train_and_report with the schedules' receives placed right before their compute (Grouping.ADJACENT,
    the grouping before the pairing): under NCCL semantics interleaved schedules deadlock (the group's
    timeout then fails the job). Used by hand; a deadlocked pool is broken for later jobs."""
    from megaframe.pipeline.grouping import build_schedule
    from megaframe.pipeline.schedule import Grouping
    from megaframe.training import step

    fixed = step.build_schedule
    step.build_schedule = lambda *args: build_schedule(*args, grouping=Grouping.ADJACENT)
    try:
        return train_and_report(mesh, overrides, steps)
    finally:
        step.build_schedule = fixed
