"""Which rank is slow: per-rank compute time of the step, gathered at log steps only.

Compute time is the sum of this rank's forward and backward actions as the pipeline executor times
them (its `timeline`): tensor-parallel collectives inside a layer are included, pipeline receives
and every data-parallel / optimizer collective are not, so a rank that waits for a slow peer does
not look slow itself. An injected delay (megaframe.runops.faults) counts as compute.

At a log step every rank contributes its mean compute seconds per step since the last log to one
small all-gather over the whole mesh (8 bytes per rank); the logged figures are
straggler/compute_s_min, straggler/compute_s_max and straggler/slowest_rank (the global rank).
On CUDA the spans are host times of asynchronous kernels: they show launch-bound stalls, not a slow
GPU, unless the step synchronises.
"""

from __future__ import annotations

import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh
from megaframe.runops.faults import Injector


class StragglerProbe:
    """Passed to optimizer_step: begin(step) opens the step's compute window; `spans` is the executor's
    timeline of (action, start, end)."""

    def __init__(self, injector: Injector | None = None):
        self.injector = injector
        self.spans: list = []
        self.compute_s, self.steps = 0.0, 0

    def begin(self, step: int) -> None:
        # the previous step's spans: the executor fills them during optimizer_step, after begin()
        self._fold()
        self.steps += 1
        if self.injector is not None:
            self.compute_s += self.injector.apply(step)

    def _fold(self) -> None:
        self.compute_s += sum(end - start for _, start, end in self.spans)
        self.spans.clear()

    def gather(self, mesh: Mesh) -> dict:
        """Collective over the mesh: the straggler figures since the last call (every rank gets them)."""
        self._fold()
        mine = self.compute_s / max(1, self.steps)
        self.compute_s, self.steps = 0.0, 0
        # host tensors: the mesh's world group is gloo on every device (and the figure is a host float)
        local = torch.tensor([mine], dtype=torch.float64)
        if mesh.group is None:
            every = local
        else:
            every = torch.empty(mesh.world, dtype=torch.float64)
            with mesh.stats.noting(
                "all_gather(straggler)", "world", range(mesh.world), local.shape, local.dtype, 8
            ):
                comm.all_gather_world(every, local, mesh.group)
        # host values: no device sync
        values = every.tolist()
        slowest = max(range(len(values)), key=values.__getitem__)
        return {
            "straggler/compute_s_min": min(values),
            "straggler/compute_s_max": values[slowest],
            "straggler/slowest_rank": slowest,
        }
