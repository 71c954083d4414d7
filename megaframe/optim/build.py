"""AdamW over this rank's parameter slices. Adam is elementwise, so sharding never changes the math."""
from __future__ import annotations

import torch
from torch import nn

from megaframe.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only (never norms or biases); fused kernels on CUDA, foreach on CPU."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
