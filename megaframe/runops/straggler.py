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

Those figures miss a slow rank under tp or ZeRO-2: its tp peers wait inside their own layers (their compute
time grows too) and reduce-scatters launched from backward hooks even out the backward time. So the same
log-step gather also carries each rank's holds in every collective (parallel/observe.py) and names the rank
the others wait for, by arrival (runops/arrivals.py: straggler/last_arrival_*), with a warning once it
persists; and each rank's memory peak (mem/rank<R>/peak_bytes).
"""

from __future__ import annotations

import resource
import socket
import sys

import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh
from megaframe.parallel.observe import Observer
from megaframe.runops import arrivals
from megaframe.runops.faults import Injector


def busy_seconds(spans: list) -> float:
    """Seconds inside any of the (action, start, end) spans: their union, so an overlapped kind's pair (a
    forward and a backward at once, pipeline/overlap.py) counts its shared time once."""
    total, reach = 0.0, float("-inf")
    for _, start, end in sorted(spans, key=lambda s: s[1]):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class StragglerProbe:
    """Passed to optimizer_step: begin(step) opens the step's compute window; `spans` is the executor's
    timeline of (action, start, end)."""

    def __init__(self, injector: Injector | None = None):
        self.injector = injector
        self.spans: list = []
        self.compute_s, self.steps = 0.0, 0
        self.persist = arrivals.Persistence()

    def watch(self, mesh: Mesh) -> Observer:
        """Note every rank's hold in each collective from now on (runops/arrivals.py)."""
        mesh.stats.observer = mesh.stats.observer or Observer(arrivals=False)  # on inside steps
        return mesh.stats.observer

    def begin(self, step: int) -> None:
        # the previous step's spans: the executor fills them during optimizer_step, after begin()
        self._fold()
        self.steps += 1
        if self.injector is not None:
            self.compute_s += self.injector.apply(step)

    def _fold(self) -> None:
        self.compute_s += busy_seconds(self.spans)
        self.spans.clear()

    def gather(self, mesh: Mesh, step: int = 0, step_time: float = 0.0) -> dict:
        """Collective over the mesh: the straggler figures since the last call (every rank gets them)."""
        self._fold()
        mine = self.compute_s / max(1, self.steps)
        steps, self.compute_s, self.steps = self.steps, 0.0, 0
        row = self._compute_figures(mesh, mine)
        if mesh.stats.observer is not None:
            row.update(self._arrival_figures(mesh, step, steps, step_time))
        return row

    def _arrival_figures(self, mesh: Mesh, step: int, steps: int, step_time: float) -> dict:
        """Every rank's holds, host and memory peak, gathered over the mesh (a log step's collective)."""
        holds, p2p = mesh.stats.observer.take()
        mine = {"holds": holds, "p2p": p2p, "host": socket.gethostname(), "peak": peak_bytes(mesh)}
        every = comm.gather_objects(mine, mesh.group)
        row, named = arrivals.window([e["holds"] for e in every], steps, step_time, [e["p2p"] for e in every])
        line = self.persist.update(named, [e["host"] for e in every], step)
        if line and mesh.rank == 0:
            print(line, file=sys.stderr, flush=True)
        peaks = [e["peak"] for e in every]
        row["mem/peak_bytes_max_rank"] = max(range(len(peaks)), key=peaks.__getitem__)
        row.update({f"mem/rank{r}/peak_bytes": p for r, p in enumerate(peaks[:MEMORY_RANKS])})
        return row

    def _compute_figures(self, mesh: Mesh, mine: float) -> dict:
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


MEMORY_RANKS = 64
"""Per-rank memory peaks are logged for the first this many ranks (mem/rank<R>/peak_bytes); the rank of
the highest peak always."""


def peak_bytes(mesh: Mesh) -> int:
    """This rank's peak memory: the CUDA allocator's on a GPU, the process's peak resident set on CPU."""
    if mesh.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(mesh.device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux counts KiB
