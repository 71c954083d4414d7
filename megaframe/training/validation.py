"""Validation loss: forward-only over a fixed set of validation micro-batches, mean token loss over dp.

The set is the first train.eval_iters global batches of the validation split's own seeded order, split
over dp ranks exactly like training batches, so val_loss is the same number under every layout and at
every evaluation the same samples are scored (a curve, not noise from resampling).

How a loss comes out of the model is in one function, `loss_sum`: the training executor running a
forward-only schedule (GPipe's forward phase, pp = 1 included), so evaluation moves activations through
the same paired p2p batches as training.
"""

from __future__ import annotations

import torch

from megaframe.config.schema import TrainConfig
from megaframe.data.dataset import BatchShape, microbatches
from megaframe.pipeline.executor import reduce_loss, run_schedule
from megaframe.pipeline.grouping import forward_schedule


class Evaluator:
    """Built once per run; `maybe(step, model)` returns val_loss at evaluation steps, else None."""

    def __init__(self, t: TrainConfig, mesh, data, seq_length: int):
        """`data`: the validation split's samples; `seq_length`: model.seq_length (tokens per sample)."""
        self.t, self.mesh, self.data = t, mesh, data
        self.tokens = t.eval_iters * t.global_batch_size * seq_length

    @classmethod
    def build(cls, t: TrainConfig, mesh, valid, seq_length: int) -> "Evaluator | None":
        """None unless train.eval_interval > 0; `valid()` reads the validation samples only then (its
        OSError/ValueError is the caller's ConfigError)."""
        return cls(t, mesh, valid(), seq_length) if t.eval_interval > 0 else None

    def due(self, step: int) -> bool:
        return step % self.t.eval_interval == 0 or step == self.t.max_steps

    def maybe(self, step: int, model) -> float | None:
        return self.evaluate(model) if self.due(step) else None

    def evaluate(self, model, beat=None) -> float:
        """The validation loss; `beat()`, when given, after each global batch (the hang watchdog hears it)."""
        t, mesh = self.t, self.mesh
        was_training = model.training
        model.eval()  # no dropout
        total = torch.zeros((), device=mesh.device)
        counted = mesh.stats.pop()  # the step's comm_bytes must not include evaluation traffic
        try:
            with torch.no_grad():
                for k in range(t.eval_iters):
                    # batch k of the validation split's own order: the same samples at every evaluation, split
                    # over dp like training
                    shape = BatchShape(t.global_batch_size, t.micro_batch_size, t.seed)
                    batches = microbatches(self.data, k, shape, mesh)
                    total += loss_sum(model, batches, mesh)
                    if beat is not None:
                        beat()
            # the evaluation's one host sync; meaningful on the last pipeline stage
            return reduce_loss(total, model, mesh).item() / self.tokens
        finally:
            model.train(was_training)
            mesh.stats.pop()
            # evaluation traffic is dropped; the step's counts taken before it are put back
            for group, nbytes in counted.items():
                mesh.stats.add(group, nbytes)


def loss_sum(model, batches, mesh) -> torch.Tensor:
    """Sum of token losses of this rank's micro-batches (0 off the last pipeline stage): the training
    executor running a forward-only schedule (pp = 1 included), under the caller's no_grad."""
    actions = forward_schedule(
        mesh.pp.size, len(model.stage.chunks), len(batches), mesh.pp.rank, model.stage.v
    )
    return run_schedule(actions, model, batches, mesh, None, tokens_global=1)
