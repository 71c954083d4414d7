"""One optimizer step: forward/backward over this rank's micro-batches, then the optimizer's step
(gradient reductions, clipping, AdamW). Returns device tensors; nothing here syncs the host.

Each micro-batch's loss is its token-loss sum divided by the global batch's token count, so the
gradients summed over micro-batches and dp ranks are exactly those of the mean loss of the global
batch, whatever the layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.config import Config
from megaframe.optim.schedule import lr_at
from megaframe.parallel.mesh import Mesh


@dataclass
class StepResult:
    loss_sum: torch.Tensor
    """Sum of token losses over this rank's micro-batches (not yet reduced over dp)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    lr: float


def forward_backward(model, optimizer, batches, tokens_global: int) -> torch.Tensor:
    loss_sum = torch.zeros((), device=batches[0][0].device)
    for i, (input_ids_BS, labels_BS) in enumerate(batches):
        loss_BS = model(input_ids_BS, labels_BS)
        total = loss_BS.float().sum()
        with optimizer.backward_context(is_last=i == len(batches) - 1):
            (total / tokens_global).backward()
        loss_sum += total.detach()
    return loss_sum


def train_step(model, optimizer, batches, mesh: Mesh, cfg: Config, step: int) -> StepResult:
    """Run optimizer step number `step` (1-based) on `batches`, this rank's micro-batches."""
    tokens_global = cfg.train.global_batch_size * cfg.model.seq_length
    optimizer.zero_grad()
    loss_sum = forward_backward(model, optimizer, batches, tokens_global)
    o = cfg.optim
    lr = lr_at(step, o.lr, o.min_lr, o.warmup_steps, cfg.train.max_steps)
    norm = optimizer.step(lr)
    return StepResult(loss_sum, norm, lr)
