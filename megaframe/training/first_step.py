"""The first step under train.compile=true: slow is not hung.

Each block compiles at its first call, so a run's first step lasts as long as its compiles. With pp,
stage k's first receives are enqueued at once while stages 0..k-1 compile one after another: at pp 4-8
with minutes of compile per stage, the wait outlasts train.dist_timeout_s (NCCL's watchdog counts from
enqueue) and train.hang_timeout_s, and a healthy run is killed. For that step only, every mesh group's
collectives and the hang watchdog get train.compile_timeout_s; both limits go back afterwards.
"""

from __future__ import annotations

import contextlib
import datetime

from torch.distributed.distributed_c10d import _set_pg_timeout

from megaframe.parallel.mesh import Mesh, RankGrid
from megaframe.runops.watchdog import Watchdog

AXES = RankGrid.AXES + RankGrid.EXPERT_AXES


def step_groups(mesh: Mesh) -> list:
    """Every distinct process group the step's collectives use (not the world group: checkpoints only)."""
    groups: dict = {}
    for name in AXES:
        axis = getattr(mesh, name, None)
        # the twin too: the overlapped kinds' second lane (parallel/lanes.py) runs half the step's collectives
        for group in (axis.group, axis.twin) if axis is not None else ():
            if group is not None:
                groups[id(group)] = group
    return list(groups.values())


@contextlib.contextmanager
def first_step_limits(mesh: Mesh, watchdog: Watchdog | None, limit_s: float, dist_timeout_s: float):
    """Within: the step's groups time out after `limit_s` (torch's per-group default timeout, read by
    every collective enqueued from then on), the watchdog judges by `limit_s` too."""
    groups = step_groups(mesh)
    for g in groups:
        _set_pg_timeout(datetime.timedelta(seconds=limit_s), g)
    with watchdog.suspended(limit_s) if watchdog is not None else contextlib.nullcontext():
        try:
            yield
        finally:
            for g in groups:
                _set_pg_timeout(datetime.timedelta(seconds=dist_timeout_s), g)
