"""Validation loss: forward-only over a fixed set of validation micro-batches, mean token loss over dp.

The set is the first train.eval_iters global batches of the validation split's own seeded order, split
over dp ranks exactly like training batches, so val_loss is the same number under every layout and at
every evaluation the same samples are scored (a curve, not noise from resampling).

How a loss comes out of the model is in one function, `loss_sum`: with one pipeline stage it is
model(input_ids, labels) -> per-token loss [B, S]; over pp stages a plain forward-only walk of the
stages (no overlap: evaluation is rare, and this keeps it independent of the training schedules).
"""
from __future__ import annotations

import torch

from megaframe.data.dataset import build_data, microbatches
from megaframe.parallel import comm
from megaframe.pipeline import p2p


class Evaluator:
    """Built once per run; `maybe(step, model)` returns val_loss at evaluation steps, else None."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.data = build_data(cfg, split="valid")  # OSError/ValueError: the caller's ConfigError

    @classmethod
    def build(cls, cfg, mesh) -> "Evaluator | None":
        return cls(cfg, mesh) if cfg.train.eval_interval > 0 else None

    def due(self, step: int) -> bool:
        return step % self.cfg.train.eval_interval == 0 or step == self.cfg.train.max_steps

    def maybe(self, step: int, model) -> float | None:
        return self.evaluate(model) if self.due(step) else None

    def evaluate(self, model) -> float:
        t, mesh = self.cfg.train, self.mesh
        was_training = model.training
        model.eval()  # no dropout
        total = torch.zeros((), device=mesh.device)
        counted = mesh.stats.pop()  # the step's comm_bytes must not include evaluation traffic
        try:
            with torch.no_grad():
                for k in range(t.eval_iters):
                    # batch k of the validation split's own order: the same samples at every evaluation, split over dp like
                    # training
                    batches = microbatches(self.data, k, t.global_batch_size, t.micro_batch_size, mesh.dp.rank,
                                           mesh.dp.size, t.seed, mesh.device, cp_rank=mesh.cp.rank,
                                           cp_size=mesh.cp.size)
                    total += loss_sum(model, batches, mesh)
            tokens = t.eval_iters * t.global_batch_size * self.cfg.model.seq_length
            # the evaluation's one host sync
            return comm.all_reduce(total, mesh.dpcp).item() / tokens  # meaningful on the last pipeline stage
        finally:
            model.train(was_training)
            mesh.stats.pop()
            # evaluation traffic is dropped; the step's counts taken before it are put back
            for group, nbytes in counted.items():
                mesh.stats.add(group, nbytes)


def loss_sum(model, batches, mesh) -> torch.Tensor:
    """Sum of token losses of this rank's micro-batches (0 off the last pipeline stage)."""
    total = torch.zeros((), device=mesh.device)
    if mesh.pp.size == 1:
        for input_ids_BS, labels_BS in batches:
            total += model(input_ids_BS, labels_BS).float().sum()  # fp32 sum over many tokens
        return total
    pp, rank = mesh.pp.size, mesh.pp.rank
    last = pp * len(model.stage.chunks) - 1
    dtype = next(model.parameters()).dtype
    for input_ids_BS, labels_BS in batches:
        b, s = input_ids_BS.shape
        shape = (s // mesh.tp.size if model.sp else s, b, model.cfg.hidden_size)
        for chunk in range(len(model.stage.chunks)):
            stage = chunk * pp + rank
            x_SBD = None
            if stage > 0:  # receive the previous stage's activations
                x_SBD = torch.empty(shape, dtype=dtype, device=mesh.device)  # shape from the config: no shape exchange
                # blocking, one micro-batch at a time (evaluation is rare); modulo: a virtual chunk's previous stage wraps round
                # to the last rank
                p2p.start(mesh.pp, [], [(x_SBD, (rank - 1) % pp)]).wait()
            out = model.forward_chunk(chunk, x_SBD, input_ids_BS, labels_BS)
            if stage == last:
                total += out.float().sum()
            else:
                p2p.start(mesh.pp, [(out.contiguous(), (rank + 1) % pp)], []).wait()
    return total
