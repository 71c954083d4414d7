"""Learning-rate schedules: linear warmup from 0, then a decay to min_lr over the decay horizon.

A pure function of the step and the horizon, so resuming needs no scheduler state: the horizon
(optim.lr_decay_steps, by default train.max_steps of the run's first start) is recorded in every
checkpoint's config and adopted on resume, so raising train.max_steps on a resume does not reshape the
curve; past the horizon the rate stays at min_lr.

  cosine    min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,  p = (step - warmup) / (horizon - warmup)
  linear    lr - (lr - min_lr) * p
  wsd       warmup-stable-decay: lr until the last optim.wsd_decay_fraction of the horizon, then linear
            to min_lr at the horizon (the decay phase can be re-run from a stable-phase checkpoint)
  constant  lr after warmup
"""

from __future__ import annotations

import math

from megaframe.config.schema import LRSchedule


def lr_at(
    step: int,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    decay_steps: int,
    schedule: LRSchedule = LRSchedule.cosine,
    wsd_decay_fraction: float = 0.2,
) -> float:
    """Learning rate of optimizer step `step` (1-based: the first update is step 1); `decay_steps` is
    the horizon (counted from step 0, warmup included) at which the rate reaches min_lr."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    schedule = LRSchedule(schedule)
    if schedule is LRSchedule.constant:
        return lr
    if schedule is LRSchedule.wsd:
        # the decay phase is the last fraction of the horizon, never reaching into warmup
        start = max(warmup_steps, decay_steps - round(wsd_decay_fraction * decay_steps))
        if step <= start:
            return lr
        # max(1, ...): a decay phase of zero steps (tiny horizons) must not divide by zero.
        progress = min(1.0, (step - start) / max(1, decay_steps - start))
        return lr - (lr - min_lr) * progress
    # Clamped at 1: past the horizon (a resume with more steps) the rate stays at min_lr.
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    if schedule is LRSchedule.linear:
        return lr - (lr - min_lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_warnings(o, max_steps: int) -> list[str]:
    """What a user would not see coming in the lr curve of a run to `max_steps` (o: the OptimConfig, its
    horizon resolved): a run that ends inside the warmup, a horizon inside the warmup (the rate falls from
    its peak to min_lr in one step), a run that ends before its horizon (it never reaches min_lr)."""
    horizon, warm, out = o.lr_decay_steps or max_steps, o.warmup_steps, []
    at = lr_at(max_steps, o.lr, o.min_lr, warm, horizon, o.lr_schedule, o.wsd_decay_fraction)
    if max_steps < warm:
        out.append(
            f"optim.warmup_steps={warm} > train.max_steps={max_steps}: the run ends inside the warmup, "
            f"at lr {at:.2e} of optim.lr={o.lr:.2e}"
        )
    decays = LRSchedule(o.lr_schedule) is not LRSchedule.constant
    if decays and warm >= horizon:
        out.append(
            f"optim.warmup_steps={warm} >= the decay horizon {horizon} (optim.lr_decay_steps): the lr falls "
            f"from its peak to optim.min_lr={o.min_lr:.2e} at "
            f"step {warm + 1} (also in a resume with more steps)"
        )
    if decays and warm < max_steps < horizon:
        out.append(
            f"train.max_steps={max_steps} < the decay horizon {horizon} (optim.lr_decay_steps): the run ends "
            f"at lr {at:.2e}, before the decay reaches optim.min_lr={o.min_lr:.2e} "
            f"(optim.lr_decay_steps={max_steps} ends it there)"
        )
    return out
