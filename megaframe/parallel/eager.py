"""Functions that stay eager inside a torch.compile'd block, without importing the compiler in a run that
never compiles.

`torch.compiler.disable(fn)` imports torch._dynamo (and with it inductor's config): about a third of the
CPU time of a one-step run, paid by every process whether it compiles or not. `eager(fn)` instead returns
a thin callable that calls fn; `arm()`, called by whatever compiles before its first trace
(model/parallelize.py's compile_blocks), swaps each one's target for `torch.compiler.disable(fn)`. Dynamo,
inlining the callable, then meets a disabled function and runs it eagerly between the compiled pieces: the
same graph break the module-level `torch.compiler.disable` gave. Callables made after `arm()` are armed at
once.
"""

from __future__ import annotations

import functools
from typing import Callable

_MADE: list[Eager] = []
_ARMED = [False]


class Eager:
    """fn, or torch.compiler.disable(fn) once armed."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.target = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)

    def _arm(self) -> None:
        import torch

        self.target = torch.compiler.disable(self.fn)


def eager(fn: Callable) -> Eager:
    made = Eager(fn)
    _MADE.append(made)
    if _ARMED[0]:
        made._arm()
    return made


def arm() -> None:
    """Before the first compiled call: every eager callable becomes a graph break (imports torch._dynamo)."""
    if _ARMED[0]:
        return
    _ARMED[0] = True
    for made in _MADE:
        made._arm()
