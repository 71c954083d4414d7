"""Stragglers by arrival, through the real trainer loop in the rank pool: one rank sleeps at every step's
start (MEGAFRAME_INJECT) and must be named by straggler/last_arrival_rank in >= 90 % of the log windows
under tp2.sp, zero=2 dp2, pp2 (with dp2: its stage peers do the same work) and cp2; the control (tp2.pp2,
nothing injected) names no rank twice in a row (no warning), and is also the profiled run: step 3's trace
per rank holds the named ranges, and the unprofiled steps opened no profiler range at all.

Steps 1-2 are left out of the windows: they hold start-up work on every rank (no fair race).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from unittest import mock

import pytest

pytestmark = pytest.mark.distributed

STEPS = 12
"""Ten log windows of one step (3, ..., 12): on a loaded 2-core host a rank descheduled for longer than the
injected sleep is, for that window, the rank the others wait for; >= 90 % leaves room for one such hiccup."""
SLEEP_S = 0.6
"""The injected lateness per step: far above a tiny step's compute (tens of ms) and the scheduler's usual
jitter, so each window's last arrival is the injected rank's."""
LAYOUTS = {
    # name: (world, tp, pp, cp, overrides, slow rank)
    "tp2.sp": (2, 2, 1, 1, ["parallel.tp=2", "parallel.sp=true"], 1),
    "zero2.dp2": (2, 1, 1, 1, ["optim.zero=2"], 1),
    "pp2.dp2": (4, 1, 2, 1, ["parallel.pp=2"], 1),
    "cp2": (2, 1, 1, 2, ["parallel.cp=2"], 1),
    "control.tp2.pp2": (4, 2, 2, 1, ["parallel.tp=2", "parallel.pp=2", "train.profile_steps=[3]"], None),
}


def _train(mesh, overrides, run_dir, inject):
    import torch

    from megaframe.runops.signals import StopFlag
    from megaframe.training import trainer
    from tests.distributed.cases import job_config

    cfg = job_config(
        mesh,
        overrides
        + [
            f"train.max_steps={STEPS}",
            "train.log_interval=1",
            "train.hang_timeout_s=0",
            "checkpoint.interval=0",
            f"run.dir={run_dir}",
            f"checkpoint.dir={run_dir}/checkpoints",
        ],
    )
    opened, per_step = [0], []
    real_rf, real_step = torch.autograd.profiler.record_function, trainer.optimizer_step

    def counted(*a, **k):  # every profiler range megaframe opens goes through this name
        # megaframe's own: torch.optim's step opens one of its own every step, profiled or not
        opened[0] += "/megaframe/" in sys._getframe(1).f_code.co_filename
        return real_rf(*a, **k)

    def marked(*a, **k):
        opened[0] = 0
        out = real_step(*a, **k)
        per_step.append(opened[0])
        return out

    env = {"MEGAFRAME_INJECT": inject} if inject else {}
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(torch.autograd.profiler, "record_function", counted),
        mock.patch.object(trainer, "optimizer_step", marked),
    ):
        trainer.train(cfg, mesh, StopFlag())
    return per_step


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_slow_rank_is_named_by_its_arrivals(pool, tmp_path, layout):
    world, tp, pp, cp, over, slow = LAYOUTS[layout]
    inject = f"sleep:rank={slow}:seconds={SLEEP_S}" if slow is not None else ""
    ranges = pool.run(_train, world, over, str(tmp_path), inject, tp=tp, pp=pp, cp=cp)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if r["step"] > 2]  # steps 1-2: start-up work on every rank, no fair race
    named = [r["straggler/last_arrival_rank"] for r in windows]
    old = [r["straggler/slowest_rank"] for r in windows]
    print(f"{layout}: injected {slow}, named {named}, straggler/slowest_rank {old}")
    print({k: round(v, 3) for k, v in windows[-1].items() if "last_arrival" in k})
    if slow is None:  # a host hiccup may name a rank for a window; never the same one twice in a row
        assert not any(a >= 0 and a == b for a, b in zip(named, named[1:])), named
        _check_trace(tmp_path, world, ranges)
    else:
        assert sum(n == slow for n in named) >= 0.9 * len(windows), named


def _check_trace(run_dir, world, ranges):
    """Every rank's trace of step 3 holds its actions, collectives and optimizer step; steps not profiled
    opened no range (the cost of the profiler when off)."""
    for rank in range(world):
        events = json.loads(
            gzip.decompress((run_dir / "profile" / f"rank{rank}_steps3-3.json.gz").read_bytes())
        )
        names = {e["name"].split(" ")[0] for e in events["traceEvents"] if e.get("ph") == "X"}
        assert {"step", "forward", "backward", "optimizer_step"} <= names, (rank, sorted(names)[:20])
        assert any(n.startswith("comm.all_reduce[tp]") for n in names), rank
        assert any(n.startswith("comm.p2p") for n in names), rank
    for per_step in ranges:
        assert per_step[2] > 0 and [n for i, n in enumerate(per_step) if i != 2] == [0] * (STEPS - 1)
