"""What the rank pool runs for the step-term test: ZeRO-3's most param bytes gathered at once in a step."""

from __future__ import annotations

from tests.distributed.zero_cases import _setup, _step


def gathered_high(mesh, overrides: list[str]) -> int:
    """Two steps (the second with every lazy buffer built); the most gathered param bytes alive at once."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 2)
    for step in (1, 2):
        _step(mesh, cfg, model, optimizer, data, step)
    return optimizer.gathered_high
