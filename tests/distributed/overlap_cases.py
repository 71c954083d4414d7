"""Rank-pool functions for the overlapped pipeline kinds (pipeline/overlap.py)."""

from __future__ import annotations

from megaframe.optim.build import build_optimizer
from megaframe.pipeline.schedule import compute_order, paired_forwards, resolve_kind
from tests.distributed.cases import job_config, rank_batches
from tests.forms import build_data, build_model, train_step


class _Spans:
    """The executor's timeline of one step (what training.straggler.StragglerProbe collects)."""

    def __init__(self):
        self.spans: list = []

    def begin(self, step: int) -> None:
        pass


def pairs_at_once(mesh, overrides: list[str]) -> dict | None:
    """One step; rank 0 returns how many of its forward-backward pairs ran at once (their spans intersect)
    out of all, and the collectives entered on each lane."""
    cfg = job_config(mesh, overrides + ["train.max_steps=1"])
    model = build_model(cfg, mesh)
    optimizer, data = build_optimizer(model, cfg.optim, mesh), build_data(cfg)
    batches = rank_batches(data, 1, cfg, mesh)
    probe = _Spans()
    mesh.stats.on_lane[:] = [0, 0]
    train_step(model, optimizer, batches, mesh, cfg, 1, probe=probe)
    span = {a: (t0, t1) for a, t0, t1 in probe.spans}
    vpp = cfg.parallel.vpp
    kind = resolve_kind(cfg.parallel.pp_schedule.value, vpp)
    order = compute_order(kind, mesh.pp.size, vpp, len(batches), mesh.pp.rank)
    pairs = [
        (order[i], order[i + 1]) for i in paired_forwards(kind, mesh.pp.size, vpp, len(batches), mesh.pp.rank)
    ]
    at_once = sum(1 for f, b in pairs if span[f][0] < span[b][1] and span[b][0] < span[f][1])
    if mesh.rank != 0:
        return None
    return {"pairs": len(pairs), "at_once": at_once, "on_lane": list(mesh.stats.on_lane)}


def report_switching_often(mesh, overrides: list[str], steps: int) -> dict | None:
    """cases.train_and_report (dropout seeded per step), with the interpreter switching threads every 10
    microseconds: a pair's two threads then interleave at many more points than at the default 5 ms."""
    import sys

    from tests.distributed.cases import train_and_report

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        return train_and_report(mesh, overrides, steps, None, True)
    finally:
        sys.setswitchinterval(interval)
