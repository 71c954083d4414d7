"""The optimizer contract the training loop, the pipeline executor and checkpoints drive. Three classes
implement it: PlainOptimizer (optim.zero=0, build.py), ZeroOptimizer (ZeRO-1/-2, zero.py) and
Zero3Optimizer (zero3.py). An ABC rather than a docstring: a class missing a method cannot be built.

The update's math is the rule's (optim/update_rule.py, chosen by optim.name; `rule` on every optimizer):
these classes are the distribution strategy, holding the rule's state under its names. An elementwise rule
(AdamW) run on each rank's parameter slices never changes the math."""

from __future__ import annotations

import abc
import contextlib

import torch
from torch import nn

from megaframe.optim.update_rule import UpdateRule

Segments = list[tuple[int, int, dict[str, torch.Tensor]]]
"""(start in p's flat local tensor, length, {state name: view}) of a parameter's state on this rank."""


class Optimizer(abc.ABC):
    """What every optimizer offers; the call order is zero_grad, (backward_context around each
    micro-batch's backward), step; sync_params/settle before params are read outside a forward."""

    rule: UpdateRule
    """The update rule whose state this optimizer holds (its names are the checkpoint's optim/<name>/)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Before a step's first micro-batch."""

    @abc.abstractmethod
    def backward_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Around each micro-batch's backward; `is_last` marks the final backward of a parameter set
        (where reductions may start early)."""

    @abc.abstractmethod
    def step(self, lr: float) -> torch.Tensor:
        """finalize.py's one path (tied copies, dp, tp partials, norm, clip), then the update; returns the
        global grad norm before clipping. A non-finite norm skips the update (the trainer counts such
        steps)."""

    @abc.abstractmethod
    def logical_state(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """The rule's state (and a master copy if kept) shaped like p's local slice (checkpoints)."""

    @abc.abstractmethod
    def load_targets(self, p: nn.Parameter) -> tuple[Segments, bool]:
        """Where a checkpoint's state of p is read to, in place, and whether a master of p is kept (else
        the saved master goes into p itself): checkpoint/load.py."""

    @abc.abstractmethod
    def loaded(self, p: nn.Parameter, kinds: set[str], step: int) -> None:
        """What to finish once load_targets' segments (the `kinds` the checkpoint held) and p were read."""

    @abc.abstractmethod
    def held_state(self) -> list[torch.Tensor]:
        """Every optimizer state tensor this rank holds now (no collective): the save guard's finite check."""

    @abc.abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """mem/grads_bytes and mem/optim_bytes (and any further mem/ figures) of this rank."""

    @abc.abstractmethod
    def sync_params(self) -> None:
        """Wait for parameter updates still in flight (ZeRO's overlapped all-gather) before reading params
        outside a forward."""

    @abc.abstractmethod
    def settle(self) -> None:
        """Before a save: what sync_params does, except under ZeRO-3, whose save writes each rank's segments
        and gathers nothing."""
