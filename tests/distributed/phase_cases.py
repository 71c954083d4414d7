"""What the rank pool runs for the per-phase memory test: the trainer's phases on this rank, measured by its
own meter (megaframe/training/phase_run.py)."""

from __future__ import annotations

from megaframe.training.phase_run import measure_phases as _measure
from tests.distributed.cases import tiny_config


def measure_phases(mesh, overrides: list[str], folder: str) -> dict:
    """This rank's (pp, tp) coordinate and its four phase peaks, as the trainer would log them."""
    return _measure(mesh, tiny_config(overrides + ["train.max_steps=1"], mesh.world), folder)
