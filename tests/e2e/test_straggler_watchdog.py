"""Straggler figures and the hang watchdog, end to end under torchrun with 2 ranks (dp=2) and
injected faults (MEGAFRAME_INJECT). Every subprocess has a hard timeout."""

import time

import pytest

from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e

BASE = ["data=synthetic", *TINY, "checkpoint.resume=none", "checkpoint.interval=0"]


def test_injected_sleep_names_the_slow_rank(tmp_path):
    res = train(
        BASE + ["train.max_steps=6", "train.log_interval=3", f"run.dir={tmp_path}"],
        nproc=2,
        timeout=180,
        launcher="env",  # the ranks' arrivals are the subject, not torchrun
        MEGAFRAME_INJECT="sleep:rank=1:seconds=0.3",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 3, 6]  # step 1 is always logged
    for row in rows[1:]:  # the first step's compute includes start-up work on every rank: not a fair race
        print({k: v for k, v in row.items() if k.startswith("straggler/")})
        assert row["straggler/slowest_rank"] == 1
        # the slow rank's compute holds the sleep; the other's is not bounded: on a loaded host its tiny
        # step alone has taken 0.38 s
        assert row["straggler/compute_s_max"] >= 0.3


def test_injected_hang_trips_the_watchdog_on_every_rank(tmp_path):
    t0 = time.perf_counter()
    res = train(
        BASE
        + ["train.max_steps=20", "train.log_interval=1", "train.hang_timeout_s=4", f"run.dir={tmp_path}"],
        nproc=2,
        timeout=120,
        MEGAFRAME_INJECT="hang:rank=1:step=3",
    )
    elapsed = time.perf_counter() - t0
    print(f"exit {res.returncode} after {elapsed:.1f}s")
    assert res.returncode != 0
    assert "injected hang at step 3" in res.stderr
    reports = {r: (tmp_path / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    for r, text in reports.items():
        print(text[:1500])
        assert f"rank {r}: HANG: no progress" in text and "after step 3" in text
        assert "python stacks" in text and "collectives entered" in text
        assert text.splitlines()[0] in res.stderr  # the same report went to stderr
    assert "faults.py" in reports[1] and "in apply" in reports[1]  # rank 1 sits in the injected hang
    # rank 0 waits for rank 1 in the dp reduce-scatter of step 3: launched during backward, waited for
    # in the optimizer step; its main thread's stack comes first
    stuck = [ln for ln in reports[0].splitlines() if "NOT WAITED FOR YET" in ln]
    assert stuck and all("reduce_scatter_flat" in ln for ln in stuck), stuck
    main_stack = reports[0].split("thread MainThread:")[1].split("  thread ")[0]
    assert "optimizer.step" in main_stack and "wait()" in main_stack
    assert max(r["step"] for r in metrics(tmp_path)) == 2
