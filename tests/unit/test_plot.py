"""megaframe.plot: several runs on one PNG; a step logged
twice counts once (the later line); bad input exits 2."""

import json

from megaframe.plot import main, read_run


def write_run(d, rows):
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.yaml").write_text("train:\n  global_batch_size: 4\nmodel:\n  seq_length: 8\n")


def test_two_runs_one_png(tmp_path, capsys):
    row = lambda s, loss: {
        "step": s,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 100.0,
        "mfu": 0.1,
    }
    write_run(tmp_path / "a", [row(1, 5.0), row(2, 4.0), row(2, 3.5), {**row(3, 3.0), "val_loss": 3.2}])
    write_run(tmp_path / "b", [row(1, 6.0), row(2, 5.0)])
    assert [r["loss"] for r in read_run(tmp_path / "a")] == [5.0, 3.5, 3.0]
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_panels_on_a_grid_with_mfu_in_percent(tmp_path):
    """One row of 5 panels (1600 x 272 px), MFU a raw fraction."""
    import struct

    from megaframe.plot import PANELS, SCALE

    rows = [
        {"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.1}
        for s in range(1, 11)
    ]
    write_run(tmp_path / "a", rows)
    out = tmp_path / "c.png"
    assert main([str(tmp_path / "a"), "--out", str(out)]) == 0
    width, height = struct.unpack(">II", out.read_bytes()[16:24])  # the PNG's IHDR
    assert height >= 450 and width / height < 2.5, (width, height)
    assert dict(PANELS)["mfu"] == "MFU (%)" and SCALE["mfu"] == 100.0


def test_the_token_axis_follows_the_consumed_counts_across_a_batch_change(tmp_path):
    """A run resumed at step 4 with global batch 16 -> 32 (seq 128): step 8 is at 160 consumed samples,
    20,480 tokens, not step x the first config's 2,048 tokens (16,384); consumed_tokens wins where
    logged (a RoPE resume at another seq_length), and old rows without counts keep step x tokens."""
    from megaframe.plot import token_positions

    run = tmp_path / "r"
    write_run(run, [{"step": s, "loss": 1.0} for s in (1, 4, 8)])
    (run / "config.yaml").write_text("train:\n  global_batch_size: 16\nmodel:\n  seq_length: 128\n")
    (run / "config.resume-4.yaml").write_text("train:\n  global_batch_size: 32\nmodel:\n  seq_length: 128\n")
    rows = [
        {"step": 1, "consumed_samples": 16},
        {"step": 4, "consumed_samples": 64},
        {"step": 8, "consumed_samples": 160},
    ]
    assert token_positions(run, rows) == [2048, 8192, 20480]
    (run / "config.resume-4.yaml").write_text("train:\n  global_batch_size: 64\nmodel:\n  seq_length: 64\n")
    rows[2] = {"step": 8, "consumed_samples": 320, "consumed_tokens": 28672}
    assert token_positions(run, rows) == [2048, 8192, 28672]
    assert token_positions(run, [{"step": 3}]) == [3 * 2048]


def _trace(path, step_us, names):
    events = [{"ph": "X", "name": "step 3", "ts": 0, "dur": step_us, "pid": 1, "tid": 1}]
    events += [
        {"ph": "X", "name": n, "ts": 10 + 100 * i, "dur": 90, "pid": 1, "tid": 1} for i, n in enumerate(names)
    ]
    events.append(
        {"ph": "X", "name": "aten::mm", "ts": 20, "dur": 5, "pid": 1, "tid": 1}
    )  # torch's own: not drawn
    path.write_text(json.dumps({"traceEvents": events}))


def test_one_profiled_step_per_rank_and_the_goodput_bar(tmp_path, capsys):
    """--trace draws the named ranges of each rank's trace (train.profile_steps), --goodput a run's wall by
    bucket; each refuses what is not one (exit 2, one line)."""
    from megaframe.plot_views import read_trace, step_ranges

    prof = tmp_path / "profile"
    prof.mkdir()
    names = [
        "forward mb0 chunk0",
        "comm.all_reduce[tp] 2048B [8, 2, 64]",
        "backward mb0 chunk0",
        "optimizer_step",
    ]
    for rank in (0, 1):
        _trace(prof / f"rank{rank}_steps3-3.json", 1000, names)
    kinds = [k for k, *_ in step_ranges(read_trace(prof / "rank0_steps3-3.json"), 3)]
    assert kinds == ["forward", "comm", "backward", "optimizer_step"]
    assert main(["--trace", str(prof), "--out", str(tmp_path / "step.png")]) == 0
    assert (tmp_path / "step.png").stat().st_size > 0 and "plot: trace" in capsys.readouterr().out
    run = tmp_path / "run"
    run.mkdir()
    row = {"step": 2, "time": 30.0, "clock/run_id": "a", "clock/start": 0.0, "clock/startup_s": 10.0,
           "clock/step_s": 15.0, "clock/checkpoint_s": 2.0}  # fmt: skip
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["--goodput", str(run), "--out", str(tmp_path / "g.png")]) == 0
    for argv in (["--trace", str(run)], ["--goodput", str(prof)], ["--trace", str(prof), str(run)]):
        assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
        assert capsys.readouterr().err.startswith("megaframe: error:")
