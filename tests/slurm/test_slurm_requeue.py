"""pretrain.sbatch on a real (local, two-node) Slurm: pre-timeout signal -> checkpoint -> requeue -> resume.

The job is submitted with `--signal=USR1@90` and a long time limit; once it trains, the test shortens the
limit (`scontrol update TimeLimit=`) so that slurmctld's own pre-timeout warning fires at its next
periodic check (every 30 s), exactly as for a job reaching its limit on a cluster. After the requeue
the limit is set long again (a requeued job on a cluster starts with its full limit) so it finishes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY
from tests.slurm.helpers import (
    ROOT,
    SBATCH_SCRIPT,
    count_lines,
    job_env,
    sbatch,
    seconds,
    show,
    tail,
    wait_done,
    wait_until,
)
from tests.slurm.wandb_history import folder_run_id, segments

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

# ~60 s of training on 4 ranks: still training when the warning comes (<= 30 s after asking). Each step
# sleeps 0.5 s on every rank (the fault injector, counted as compute): the run lasts as long as a real
# one without burning the cores the rest of the suite runs on; a larger batch than TINY's keeps float32
# reduction-order noise far below 1e-5 over all the steps
STEPS = 80
SLOW_STEPS = {"MEGAFRAME_INJECT": "sleep:seconds=0.5"}
OVER = [
    "data=synthetic",
    *TINY,
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    f"train.max_steps={STEPS}",
    "train.log_interval=1",
    "checkpoint.interval=30",
]


def _raw_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reference(tmp_path: Path) -> subprocess.Popen:
    """The same run uninterrupted in one process (the losses are layout-invariant)."""
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *OVER,
            f"run.dir={tmp_path / 'ref'}",
            "logging.wandb.mode=disabled",
        ],
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_nodes_signal_checkpoint_requeue_resume_continuous_history(slurm_cluster, tmp_path):
    t0 = time.time()
    job = sbatch(
        ["--job-name=mf-requeue", "--nodes=2", "--ntasks-per-node=2", "--time=10", "--signal=USR1@90"],
        [*OVER, "parallel.tp=2", "logging.wandb.mode=offline"],
        cwd=tmp_path,
        **SLOW_STEPS,
    )
    name = f"mf-requeue-{job}"
    run_dir, out = tmp_path / "outputs" / name, tmp_path / f"mf-requeue-{job}.out"
    ref = _reference(tmp_path)
    try:
        # training has begun on all ranks (stop handlers are installed): bring the time limit within reach
        wait_until(lambda: count_lines(run_dir / "metrics.jsonl") >= 1, 180, "the first step", job, out)
        t_train = time.time() - t0
        elapsed = seconds(show(job)["RunTime"])
        limit = math.ceil((elapsed + 50) / 60)  # the warning (90 s before) is due now; >= 20 s left after it
        subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit}"], check=True)
        wait_until(lambda: int(show(job).get("Restarts", 0)) >= 1, 120, "the requeue", job, out)
        t_requeue = time.time() - t0
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], check=True)
        info = wait_done(job, 300, out)
        t_done = time.time() - t0
        ref_out, _ = ref.communicate(timeout=300)
    finally:
        ref.kill()
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{tail(out)}"
    restarts = int(info["Restarts"])
    assert restarts >= 1 and log.count("requeueing job") == restarts, tail(out)
    assert "after SIGUSR1" in log and "resumed from" in log and "training finished" in log, tail(out)
    # the stop line says the job requeues itself (before: a manual sbatch command)
    assert f"checkpoint saved; pretrain.sbatch requeues job {job} to continue it" in log, tail(out)
    assert ref.returncode == 0, ref_out[-3000:]
    print(
        f"\njob {job}: training from {t_train:.0f}s, requeued ({restarts}x) at {t_requeue:.0f}s, "
        f"done at {t_done:.0f}s"
    )

    # metrics.jsonl: every step exactly once (the stop step is checkpointed, so nothing is redone)
    rows = _raw_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    want = _raw_metrics(tmp_path / "ref")
    for a, b in zip(rows, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])

    # wandb: one offline segment per start, all with the run folder's id; together steps 1..STEPS once each
    rid = folder_run_id(run_dir)
    segs = segments(run_dir, rid)
    assert len(segs) == restarts + 1 and rid.startswith(f"{name}-"), [s["path"] for s in segs]
    assert all(s["id"] == rid and s["exit_code"] == 0 for s in segs)
    assert all(s["config"]["train"]["max_steps"] == STEPS for s in segs)
    hist = [h for s in segs for h in s["history"]]
    assert [h["_step"] for h in hist] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in hist] == [r["loss"] for r in rows]


def test_torchrun_launcher_per_node_stop_requeue_resume(slurm_cluster, tmp_path):
    """MEGAFRAME_LAUNCHER=torchrun: one agent per node (static rendezvous, --node-rank), 2 workers each. The
    stop comes from `scancel --signal=USR1` (what --signal=USR1@T does: every process of the job's steps gets
    it); torchrun exits 1 after forwarding it, and the script still requeues from the checkpoint."""
    steps = 12
    over = ["data=synthetic", *TINY, f"train.max_steps={steps}", "train.log_interval=1"]
    # --time above the script's USR1 lead (600 s): a shorter limit signals every requeued start at once
    job = sbatch(
        ["--job-name=mf-torchrun", "--nodes=2", "--ntasks-per-node=2", "--time=20"],
        [*over, "parallel.tp=2", "logging.wandb.mode=offline"],
        cwd=tmp_path,
        MEGAFRAME_LAUNCHER="torchrun",
    )
    name = f"mf-torchrun-{job}"
    run_dir, out = tmp_path / "outputs" / name, tmp_path / f"{name}.out"
    ref = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *over,
            f"run.dir={tmp_path / 'ref'}",
            "logging.wandb.mode=disabled",
        ],
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: count_lines(run_dir / "metrics.jsonl") >= 3, 180, "step 3", job, out)
        subprocess.run(["scancel", "--signal=USR1", str(job)], check=True)
        # no `scontrol update StartTime=now` to skip the requeued job's wait (cred_expire + 1 s): started
        # inside it, slurmd refuses the launch ("Job N already killed") and the job ends FAILED
        info = wait_done(job, 240, out)
        ref_out, _ = ref.communicate(timeout=120)
    finally:
        ref.kill()
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, f"{info}\n{tail(out)}"
    assert "torchrun, 2 node(s), world 4" in log and "after SIGUSR1" in log and "resumed from" in log, tail(
        out
    )
    assert ref.returncode == 0, ref_out[-3000:]
    rows = _raw_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for a, b in zip(rows, _raw_metrics(tmp_path / "ref")):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    segs = segments(run_dir, folder_run_id(run_dir))
    assert len(segs) == 2 and [h["_step"] for s in segs for h in s["history"]] == list(range(1, steps + 1))


def test_scancel_checkpoints_without_requeue(slurm_cluster, tmp_path):
    """`scancel` (SIGTERM to every process of the job, wandb's service included) ends the job: the ranks
    still stop together with a checkpoint, and the script does not requeue."""
    over = [
        "data=synthetic",
        *TINY,
        "train.max_steps=100000",
        "train.log_interval=1",
        "logging.wandb.mode=offline",
    ]
    job = sbatch(
        ["--job-name=mf-cancel", "--nodes=1", "--ntasks-per-node=2", "--time=20"], over, cwd=tmp_path
    )
    run_dir, out = tmp_path / "outputs" / f"mf-cancel-{job}", tmp_path / f"mf-cancel-{job}.out"
    wait_until(lambda: count_lines(run_dir / "metrics.jsonl") >= 2, 180, "step 2", job, out)
    subprocess.run(["scancel", str(job)], check=True)
    info = wait_done(job, 120, out)
    log = out.read_text()
    assert info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 0, f"{info}\n{tail(out)}"
    assert "after SIGTERM" in log and "not requeueing" in log, tail(out)
    # wandb's service died of the same signal: shut down by the run, not by wandb's atexit hook's traceback
    assert "Exception ignored" not in log, tail(out)
    # not requeued: the stop line names the submitted script and the run to resubmit
    assert f"continue with: MEGAFRAME_RUN_NAME=mf-cancel-{job} sbatch {SBATCH_SCRIPT} " in log, tail(out)
    last = _raw_metrics(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
