"""Where metrics go besides metrics.jsonl: TensorBoard events hold every scalar of metrics.jsonl at its step,
one run across restarts (a restart from an earlier checkpoint hides what the earlier start logged after it);
the tensorboard package missing, or an event folder that cannot be made, is refused before any rank starts."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.errors import fail
from megaframe.tracking import Tracker

ROOT = Path(__file__).resolve().parents[2]


def _cfg(run_dir: Path, *over: str):
    return load_config(
        [
            "data=synthetic",
            f"run.dir={run_dir}",
            "logging.wandb.mode=disabled",
            "logging.tensorboard.enabled=true",
            *over,
        ],
        world_size=1,
        check_data=False,
    )


def _row(step: int, loss: float, **extra) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3 * step,
        "grad_norm": 0.5 + step,
        "tokens_per_s": 1000.0 + step,
        "consumed_tokens": 256 * step,
        "time": 1.7e9 + step,
        "mfu": None,  # not measured: no scalar
        "moe/layer0/load_max": 0.25 * step,
        **extra,
    }


def _start(cfg, run_dir: Path, start_step: int, rows: list[dict]) -> None:
    tracker = Tracker(cfg, str(run_dir), True, 10, start_step=start_step)
    for row in rows:
        tracker.log(row, start_step)
    tracker.finish()


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _jsonl_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """What a reader of metrics.jsonl sees: the later row winning for a step logged twice, every number
    but step and time (the events' own axes) a curve."""
    rows = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    curves: dict[str, list] = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                curves.setdefault(key, []).append((step, value))
    return curves


def _assert_same(events: dict, expected: dict) -> None:
    assert sorted(events) == sorted(expected)
    for tag, points in expected.items():
        got = events[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got, points):
            # events hold float32
            assert math.isclose(a, float(b), rel_tol=1e-6, abs_tol=1e-30), (tag, a, b)


def test_tensorboard_holds_the_scalars_of_metrics_jsonl_across_a_restart_from_an_earlier_checkpoint(
    tmp_path,
):
    pytest.importorskip("tensorboard")
    cfg = _cfg(tmp_path)
    # the first start logged steps 1..4 (its last checkpoint: step 2), then died
    _start(cfg, tmp_path, 0, [_row(s, 9.0 - s, resumed_from="") for s in range(1, 5)])
    # the restart resumes from step 2 and logs 3..5 again, with other values
    _start(cfg, tmp_path, 2, [_row(3, 1.5, resumed_step=2, flag=True), _row(4, 1.25), _row(5, 1.0)])
    events = _events(tmp_path / "tensorboard")
    _assert_same(events, _jsonl_scalars(tmp_path / "metrics.jsonl"))
    assert events["loss"] == [(1, 8.0), (2, 7.0), (3, 1.5), (4, 1.25), (5, 1.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one folder, one run
    assert "resumed_from" not in events and "mfu" not in events  # a string and a None are no scalars


def test_tensorboard_dir_is_its_own_key(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = _cfg(tmp_path / "run", f"logging.tensorboard.dir={tmp_path / 'tb'}")
    _start(cfg, tmp_path / "run", 0, [_row(1, 2.0)])
    assert _events(tmp_path / "tb")["loss"] == [(1, 2.0)]
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_tensorboard_off_by_default_writes_no_events(tmp_path):
    cfg = load_config(["data=synthetic", f"run.dir={tmp_path}", "logging.wandb.mode=disabled"], world_size=1)
    assert not cfg.logging.tensorboard.enabled and cfg.logging.tensorboard.dir == f"{tmp_path}/tensorboard"
    _start(cfg, tmp_path, 0, [_row(1, 2.0)])
    assert not (tmp_path / "tensorboard").exists()


def _train_module():
    spec = importlib.util.spec_from_file_location("train_entry", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tensorboard_on_without_the_package_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError) as e:
        _train_module().check_logging(cfg, show=False)
    assert fail(e.value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaframe: error: logging.tensorboard.enabled=true")
    assert "pip install tensorboard" in err[0]
    _train_module().check_logging(_cfg(tmp_path, "logging.tensorboard.enabled=false"), show=False)


def test_an_event_folder_that_cannot_be_made_is_refused_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"logging\.tensorboard\.dir=.*file/tb: .*is a file"):
        _cfg(tmp_path / "run", f"logging.tensorboard.dir={tmp_path / 'file' / 'tb'}")


def test_wandb_keeps_its_own_system_metrics_on(tmp_path, monkeypatch):
    """wandb records GPU/CPU/memory/network by itself (its System section), offline too: megaframe's
    wandb.init turns none of it off (docs/checkpoints.md#wandb-system-metrics-memory-goodput)."""
    import wandb

    from megaframe.tracking import _start_wandb

    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or object())
    cfg = load_config(["data=synthetic", f"run.dir={tmp_path}", "logging.wandb.mode=offline"], world_size=1)
    _start_wandb(cfg, str(tmp_path))
    assert seen["mode"] == "offline"
    settings = seen.get("settings")
    assert settings is None or not getattr(settings, "x_disable_stats", False)
