"""A new user's first day: the lr curve survives a longer resume, the log rows and the closing summary."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e
SMALL = [
    *TINY,
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.seq_length=16",
    "data=synthetic",
    "optim.min_lr=1e-4",
    "train.log_interval=1",
]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """SMALL (one layer) for 20 steps, every step logged: (its result, run dir, the metrics rows it wrote).
    The resume test continues this run; the others read what it printed and logged."""
    run_dir = tmp_path_factory.mktemp("first")
    res = train(SMALL + ["train.max_steps=20", f"run.dir={run_dir}"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res, run_dir, metrics(run_dir)


def test_resume_with_more_steps_keeps_the_lr_horizon_and_logs_an_honest_row(first):
    # before the recorded horizon, resuming with max_steps=30 re-stretched the cosine over 30 steps:
    # lr rose again above min_lr after step 20
    res, tmp_path, _ = first
    assert "(cosine)" in res.stdout  # the step line names the schedule
    # the header says the precision and the CPU threads (the harness sets OMP_NUM_THREADS=1)
    header = res.stdout.splitlines()[:5]
    assert any("| precision fp32 | threads 1 (OMP_NUM_THREADS)" in ln for ln in header), res.stdout[:1500]
    # a resume with nothing left to train says so in one line and warns about no lr curve (before: "steps
    # 21..15", an lr warning for steps it would never run, no summary)
    done = train(SMALL + ["train.max_steps=15", f"run.dir={tmp_path}"], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "megaframe: already at step 20 >= train.max_steps=15; nothing to train (raise train.max_steps)"
        in done.stdout
    ), done.stdout
    assert "warning" not in done.stderr and "run summary" not in done.stdout, done.stderr[-2000:]
    summary = [ln for ln in res.stdout.splitlines() if ln.startswith("run summary:")]
    assert len(summary) == 1 and "20 steps (1..20)" in summary[0] and "final loss" in summary[0]
    assert "step_00000020" in summary[0]
    more = train(SMALL + ["train.max_steps=30", f"run.dir={tmp_path}"], timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[19]["lr"] == pytest.approx(1e-4)
    assert all(r["lr"] == pytest.approx(1e-4) for r in rows[20:]), [r["lr"] for r in rows[20:]]
    assert all(r["time"] > 1.7e9 and r["step_time_s"] > 0 for r in rows)
    assert all(r["mfu"] is None or 0 < r["mfu"] <= 1 for r in rows)
    # the first config.yaml is kept; the resume's settings go beside it
    assert "max_steps: 20" in (tmp_path / "config.yaml").read_text()
    resumed = (tmp_path / "config.resume-20.yaml").read_text()
    assert "max_steps: 30" in resumed and "lr_decay_steps: 20" in resumed


def test_logged_loss_is_the_mean_since_the_last_log_line(first, tmp_path):
    # the same run as `first`, logged every 3rd step (and its first and last): the losses are first's
    # every-step rows. Step 1 is logged whatever the interval: its line says the run is alive, with a first
    # ETA
    third = train(
        SMALL + ["train.max_steps=20", "train.log_interval=3", f"run.dir={tmp_path / 'b'}"], timeout=120
    )
    assert third.returncode == 0, third.stderr[-2000:]
    a, b = first[2], metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 3, 6, 9, 12, 15, 18, 20]
    assert "step      1/20 |" in third.stdout and " eta " in third.stdout
    for row, lo in zip(b, (0, 1, 3, 6, 9, 12, 15, 18)):
        hi = row["step"]
        assert row["loss"] == pytest.approx(sum(r["loss"] for r in a[lo:hi]) / (hi - lo), rel=1e-5)


def test_wandb_online_without_login_is_one_line_before_training(tmp_path):
    res = train(
        ["data=synthetic", "logging.wandb.mode=online", f"run.dir={tmp_path / 'r'}"],
        timeout=60,
        WANDB_MODE="",
        HOME=str(tmp_path),
        WANDB_API_KEY="",
        NETRC=str(tmp_path / "none"),
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "wandb login" in lines[0] and "logging.wandb.mode=offline" in lines[0]
    assert "megaframe |" not in res.stdout and not (tmp_path / "r").exists()  # nothing built, nothing written


def test_pp2_header_counts_the_whole_model_and_ranks_print_no_warning(first, tmp_path):
    # before: params 0.14M at pp=2 (rank 0's stage) for a 0.28M model, and each rank printed torch's
    # FutureWarning for all_gather_into_tensor. `one`: the one-layer model's header (first's run)
    one = first[0]
    two = train(
        SMALL + ["train.max_steps=1", "model.num_layers=2", "parallel.pp=2", f"run.dir={tmp_path / 'b'}"],
        nproc=2,
        timeout=180,
        launcher="env",  # ranks started as srun does: the header and the ranks' warnings are the subject
    )
    assert two.returncode == 0, two.stderr[-2000:]
    one2 = train(
        SMALL + ["train.max_steps=1", "model.num_layers=2", f"run.dir={tmp_path / 'c'}"], timeout=120
    )
    params = lambda out: [w for w in out.split("|") if "params" in w][0].split()[1]  # noqa: E731
    assert params(two.stdout) == params(one2.stdout) != params(one.stdout)
    assert "sp=False schedule 1f1b zero=1" in two.stdout, two.stdout[:1500]  # the pipeline schedule, named
    assert "FutureWarning" not in two.stderr, two.stderr[-2000:]


def test_header_names_the_data_it_reads(tmp_path):
    from megaframe.config import load_config
    from megaframe.training.header import data_label

    demo = load_config(["data=demo"], world_size=1, check_data=False)
    assert data_label(demo).startswith("demo (")
    other = load_config(["data=demo", f"data.path={tmp_path / 'web'}"], world_size=1, check_data=False)
    assert data_label(other) == str(tmp_path / "web")  # before: `data demo:` for any corpus
    assert data_label(load_config(["data=synthetic"], world_size=1, check_data=False)) == "synthetic"
