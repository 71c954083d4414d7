"""Learning-rate schedule: linear warmup from 0, then cosine decay to min_lr at max_steps.

A pure function of the step, so resuming needs no scheduler state.
"""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based: the first update is step 1)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
