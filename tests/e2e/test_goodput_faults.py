"""Goodput of a real run with known faults (one process, twice): a save slowed by a known delay at step 3
(its checkpoint), a kill at the start of step 6 (steps 4-5 trained after that checkpoint, then lost), a
restart that resumes from step 3. Each bucket is checked against what was injected, the in-loop figures
against `python -m megaframe.goodput`, and the summary line carries them."""

import json
import sys

import pytest

from tests.e2e.helpers import TINY, run, train

pytestmark = pytest.mark.e2e

DELAY_S = 1.5
BASE = ["data=synthetic", *TINY, "train.max_steps=7", "train.log_interval=1", "checkpoint.interval=3"]


def test_lost_progress_and_checkpoint_blocking_match_the_injected_faults(tmp_path):
    first = train(
        BASE + [f"run.dir={tmp_path}"], MEGAFRAME_INJECT=f"slow_save:step=3:seconds={DELAY_S};kill:step=6"
    )
    assert first.returncode == -9 and "injected kill at step 6" in first.stderr, first.stderr[-2000:]
    second = train(BASE + [f"run.dir={tmp_path}"])
    assert second.returncode == 0, second.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    a = {r["step"]: r for r in rows if r["clock/run_id"] == rows[0]["clock/run_id"]}
    b = [r for r in rows if r["clock/run_id"] != rows[0]["clock/run_id"]]
    assert sorted(a) == [1, 2, 3, 4, 5] and [r["step"] for r in b] == [4, 5, 6, 7]
    last = rows[-1]
    # lost progress: steps 4 and 5 of the first incarnation, as its own clock timed them
    lost = a[5]["clock/step_s"] - a[3]["clock/step_s"]
    # checkpoint blocking: the slow save's delay over an ordinary save (the second run's saves: 6 and 7)
    ordinary = b[-1]["clock/checkpoint_s"] / 2
    slow = a[5]["clock/checkpoint_s"]
    # forks of the suite's warm interpreter (helpers.run), as the train runs above
    out = run([sys.executable, "-m", "megaframe.goodput", str(tmp_path), "--json"], timeout=60)
    offline = json.loads(out.stdout)
    print(
        f"lost_progress_s {last['goodput/lost_progress_s']:.3f} (truth {lost:.3f}); slow save {slow:.3f}s "
        f"= delay {DELAY_S} + ordinary {ordinary:.3f}; gap {last['goodput/gap_s']:.2f}s\n"
        + run([sys.executable, "-m", "megaframe.goodput", str(tmp_path)], timeout=60).stdout
    )
    assert last["goodput/lost_progress_s"] == pytest.approx(lost, rel=1e-6)
    # the slow save holds the injected sleep plus its own ordinary work, which varies from save to save
    # by more than an ordinary save's size on a loaded host: bound it, do not subtract an estimate
    assert DELAY_S <= slow <= DELAY_S + max(0.5, 3 * ordinary)
    assert last["goodput/checkpoint_s"] == pytest.approx(slow + b[-1]["clock/checkpoint_s"], rel=1e-6)
    assert last["goodput/incarnations"] == 2 and last["goodput/gap_s"] >= 0
    # no bucket overlaps another: a restart's start is after its predecessor's last row (to 10 ms)
    buckets = sum(last[f"goodput/{k}_s"] for k in ("productive", "startup", "data_wait", "checkpoint",
                                                   "eval", "lost_progress", "gap"))  # fmt: skip
    assert buckets <= last["goodput/wall_s"] + 0.05
    for k in ("productive", "startup", "checkpoint", "lost_progress", "gap"):
        assert offline[f"goodput/{k}_s"] == pytest.approx(last[f"goodput/{k}_s"], abs=0.05), k
    assert "| goodput " in second.stdout and "lost_progress" in second.stdout
