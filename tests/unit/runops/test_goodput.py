"""Goodput from a run folder's own rows (runops/goodput_account.py), on synthetic folders whose truth is
known: an incarnation killed at a known step after a known checkpoint, a slow save, a restart gap; the
command's table and its refusals."""

from __future__ import annotations

import json

import pytest

from megaframe import goodput as cli
from megaframe.runops import goodput_account as goodput

STEP_S = 2.0  # every step takes 2 s
SLOW_SAVE_S = 5.0


def _row(run_id, start, start_step, step, t, startup, ckpt=0.0, evals=0.0, data=0.0):
    return {
        "step": step,
        "time": t,
        "clock/run_id": run_id,
        "clock/start": start,
        "clock/start_step": start_step,
        "clock/startup_s": startup,
        "clock/startup/process_s": startup - 1.0,
        "clock/startup/setup_s": 1.0,
        "clock/step_s": STEP_S * (step - start_step),
        "clock/data_wait_s": data,
        "clock/checkpoint_s": ckpt,
        "clock/eval_s": evals,
    }


def _killed_run() -> list[dict]:
    """Incarnation a: starts at t=0, 10 s start-up, steps 1..7 logged each step, a slow save at step 4
    (5 s), killed after step 7. Incarnation b starts at t=100, resumes from step 4 (steps 5-7 lost: 6 s),
    trains steps 5..8."""
    rows, t = [], 10.0
    for s in range(1, 8):
        t += STEP_S + (SLOW_SAVE_S if s == 4 else 0.0)
        rows.append(_row("a", 0.0, 0, s, t, 10.0, ckpt=SLOW_SAVE_S if s >= 4 else 0.0))
    t = 100.0 + 8.0 + 0.5  # its start-up, and a validation of 0.5 s before its first row
    for s in range(5, 9):
        t += STEP_S
        rows.append(_row("b", 100.0, 4, s, t, 8.0, evals=0.5))
    return rows


def test_each_bucket_matches_the_injected_truth():
    rows = _killed_run()
    f = goodput.account(goodput.from_rows(rows))
    assert f["goodput/lost_progress_s"] == pytest.approx(3 * STEP_S)  # steps 5, 6, 7 of incarnation a
    assert f["goodput/productive_s"] == pytest.approx(4 * STEP_S + 4 * STEP_S)  # a: 1-4, b: 5-8
    assert f["goodput/checkpoint_s"] == pytest.approx(SLOW_SAVE_S)
    assert f["goodput/startup_s"] == pytest.approx(18.0)
    assert f["goodput/startup/setup_s"] == pytest.approx(2.0)
    assert f["goodput/eval_s"] == pytest.approx(0.5)
    assert f["goodput/gap_s"] == pytest.approx(100.0 - rows[6]["time"])
    assert f["goodput/wall_s"] == pytest.approx(rows[-1]["time"])
    assert f["goodput/incarnations"] == 2
    assert f["goodput/fraction"] == pytest.approx(16.0 / rows[-1]["time"])
    # the buckets and the rest add up to the wall
    parts = sum(f[f"goodput/{k}_s"] for k in (*goodput.BUCKETS, "other"))
    assert parts == pytest.approx(f["goodput/wall_s"])


def test_lost_progress_between_logged_rows_is_interpolated():
    """Logged every 4 steps: a resume from step 6 loses steps 7-8 of the rows (6, ..., 8)."""
    rows = [_row("a", 0.0, 0, s, 10.0 + STEP_S * s, 10.0) for s in (4, 8)]
    rows.append(_row("b", 50.0, 6, 8, 60.0, 5.0))
    f = goodput.account(goodput.from_rows(rows))
    assert f["goodput/lost_progress_s"] == pytest.approx(2 * STEP_S)


def test_a_clean_stop_and_resume_loses_nothing_and_rows_without_a_clock_are_skipped():
    rows = [{"step": 1, "time": 1.0, "loss": 3.0}]  # written before the clock existed
    rows += [_row("a", 0.0, 0, s, 10.0 + STEP_S * s, 10.0) for s in (1, 2)]
    rows += [_row("b", 30.0, 2, s, 35.0 + STEP_S * s, 5.0) for s in (3, 4)]
    f = goodput.account(goodput.from_rows(rows))
    assert f["goodput/lost_progress_s"] == 0.0 and f["goodput/productive_s"] == pytest.approx(4 * STEP_S)


def test_the_command_prints_the_table_and_refuses_a_folder_without_a_clock(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    torn = '{"clock/run_id": "x", '  # a process killed while writing its last line
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _killed_run()) + torn)
    assert cli.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "lost_progress_s" in out and "over 2 incarnation(s)" in out and "fraction" in out
    assert cli.main([str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["goodput/lost_progress_s"] == pytest.approx(6.0)
    for bad, why in [(tmp_path / "nothing", "no metrics.jsonl"), (tmp_path, "no metrics.jsonl")]:
        assert cli.main([str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("megaframe: error:") and why in err and len(err.splitlines()) == 1
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert cli.main([str(tmp_path)]) == 2
    assert "no row with a goodput clock" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "clock/run_id": "a"}\n')
    assert cli.main([str(tmp_path)]) == 2
    assert "malformed clock row" in capsys.readouterr().err


def test_the_process_start_is_read_to_the_tick():
    """psutil's create_time adds a boot time known to the second: a restart could seem to start before its
    predecessor's last row. /proc's ticks since boot against /proc/uptime do not."""
    import time

    from megaframe.training.run_clock import process_age, process_start

    assert 0 < process_age() < 24 * 3600
    assert abs(process_start() - (time.time() - process_age())) < 0.05
