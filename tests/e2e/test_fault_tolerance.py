"""Stop signals, SIGKILL under torchrun restarts, and corrupt checkpoints: the run always comes back."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, TINY, env, metrics, train

pytestmark = pytest.mark.e2e


def _launch(
    overrides: list[str], nproc: int, restarts: int = 0, cwd: Path = ROOT, **extra_env
) -> subprocess.Popen:
    """torchrun as docs/checkpoints.md writes it: no --standalone, so its run id is "none" (c10d on a free
    port, as --standalone does, but without the UUID)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        str(ROOT / "train.py"),
        *overrides,
    ]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


# SIGTERM on one rank stops all at one step with a checkpoint: tests/e2e/test_signal_interval.py (the same
# torchrun, stopped at a check step)


def test_signal_during_start_up_stops_at_the_first_step_with_a_checkpoint(tmp_path):
    """Slurm may signal a rank while it still imports torch: the flag is set before those imports."""
    over = ["data=synthetic", *TINY, "train.max_steps=100000", f"run.dir={tmp_path}"]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *over],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(0.5)  # python is up, torch is not imported yet (it takes seconds)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "stopping at step 1 after SIGUSR1" in out, out[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_sigkill_under_torchrun_restarts_resume_with_identical_losses(tmp_path):
    """Rank 0 is SIGKILLed at the start of step 6 (MEGAFRAME_INJECT=kill, the first attempt only; steps 4-5
    trained after the step-4 checkpoint are lost): torchrun restarts the group, which resumes from step 4 in
    the same run folder and ends with the losses of an uninterrupted run. (The kill is injected at a fixed
    step rather than sent from here after some metrics lines: the same SIGKILL, without a race between the
    kill and the end of the run, so the run needs 8 steps instead of 40.)"""
    over = ["data=synthetic", *TINY, "train.max_steps=8", "train.log_interval=1", "checkpoint.interval=2"]
    ref = train(over + [f"run.dir={tmp_path / 'ref'}"], nproc=1)
    assert ref.returncode == 0, ref.stderr[-2000:]
    # no run.dir: the restarted workers find the run by its name (before: torchrun's run id "none" gave each
    # start a new timestamp, and the restart trained from step 1 in a new folder)
    (tmp_path / "ft").mkdir()
    proc = _launch(over, nproc=2, restarts=1, cwd=tmp_path / "ft", MEGAFRAME_INJECT="kill:rank=0:step=6")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert "rank 0: injected kill at step 6" in out, out[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "ft").glob("outputs/*/metrics.jsonl")]
    assert f"resumed from outputs/{run_dir.name}/checkpoints/step_00000004" in out, out[-3000:]
    assert list((tmp_path / "ft" / "outputs").iterdir()) == [run_dir]
    want, got = metrics(tmp_path / "ref"), metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, 9))
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    over = [
        "data=synthetic",
        *TINY,
        "train.max_steps=6",
        "train.log_interval=1",
        "checkpoint.interval=3",
        f"run.dir={tmp_path}",
    ]
    first = train(over)
    assert first.returncode == 0, first.stderr[-2000:]
    before = metrics(tmp_path)
    shard = tmp_path / "checkpoints" / "step_00000006" / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated: a crash mid-write of an old-style save
    again = train(over)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "skipping checkpoint" in again.stderr and "step_00000006" in again.stderr
    assert "resumed from" in again.stdout and "step_00000003" in again.stdout
    after = metrics(tmp_path)  # steps 4-6 recomputed from step 3: the later lines win, and agree
    for a, b in zip(after, before):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"])
    shard.write_bytes(shard.read_bytes()[:-100])  # the re-run rewrote step 6 whole; break it again
    bad = train(over + [f"checkpoint.resume={shard.parent}"], timeout=60)
    assert bad.returncode == 2 and "corrupt" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_out_of_memory_while_loading_stops_on_that_checkpoint(tmp_path):
    """Rank 1 runs out of memory loading step 6 (MEGAFRAME_INJECT=loadoom, a torch.OutOfMemoryError inside the
    resume's load): exit 1 with the phase and the checkpoint named, no fall-back to step 3, nothing pruned or
    moved. (Before: a RuntimeError was "cannot be loaded" and the run went on from step 3.)"""
    over = ["data=synthetic", *TINY, "train.max_steps=6", "checkpoint.interval=3", f"run.dir={tmp_path}"]
    assert train(over).returncode == 0
    ck = tmp_path / "checkpoints"
    before = sorted(p.name for p in ck.iterdir()), (ck / "latest").read_text()
    lines = (tmp_path / "metrics.jsonl").read_text()
    # ranks started as srun does (no torchrun agent): the resume's load is the subject, not the launcher
    bad = train(
        over + ["train.max_steps=9"],
        nproc=2,
        timeout=180,
        launcher="env",
        MEGAFRAME_INJECT="loadoom:rank=1:step=6",
    )
    assert bad.returncode == 1, bad.stderr[-2000:]
    errors = [x for x in bad.stderr.splitlines() if x.startswith("megaframe: error:")]
    assert errors and all(
        "loading checkpoint" in x and "step_00000006 failed: rank 1: OutOfMemoryError" in x for x in errors
    ), bad.stderr[-2000:]
    assert "skipping checkpoint" not in bad.stderr and "resumed from" not in bad.stdout
    assert (sorted(p.name for p in ck.iterdir()), (ck / "latest").read_text()) == before
    assert (tmp_path / "metrics.jsonl").read_text() == lines


def test_keep_last_prunes_old_checkpoints(tmp_path):
    res = train(
        [
            "data=synthetic",
            *TINY,
            "train.max_steps=6",
            "checkpoint.interval=1",
            "checkpoint.keep_last=2",
            f"run.dir={tmp_path}",
        ]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_00000005",
        "step_00000006",
    ]


@pytest.mark.parametrize(
    "name,nproc,layout",
    [("dp2", 2, []), ("pp4", 4, ["parallel.pp=4"]), ("tp4-sp", 4, ["parallel.tp=4", "parallel.sp=true"])],
)
def test_tp2_pp2_checkpoint_resumes_under_another_layout(tmp_path_factory, name, nproc, layout):
    import shutil

    base = tmp_path_factory.getbasetemp() / "tp2pp2-source"
    over = [
        "data=synthetic",
        *TINY,
        "model.num_layers=4",
        # 4 steps, resumed at 2: the second step after the resume starts from the new layout's own update
        "train.max_steps=4",
        "train.log_interval=1",
        "checkpoint.interval=2",
        "train.micro_batch_size=1",
    ]
    if not (base / "checkpoints" / "step_00000002").is_dir():  # one source run shared by the parameters
        src = train(over + ["parallel.tp=2", "parallel.pp=2", f"run.dir={base}"], nproc=4, launcher="env")
        assert src.returncode == 0, src.stderr[-3000:]
    run = tmp_path_factory.mktemp(name)
    shutil.copytree(base / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    res = train(over + layout + [f"run.dir={run}"], nproc=nproc, launcher="env")
    assert res.returncode == 0, res.stderr[-3000:]
    want, got = metrics(base)[2:], metrics(run)
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (name, a["loss"], b["loss"])


def test_async_save_commits_every_checkpoint_and_resumes(tmp_path):
    from megaframe.checkpoint import sharded

    over = [
        "data=synthetic",
        *TINY,
        "train.max_steps=6",
        "train.log_interval=1",
        "checkpoint.interval=2",
        "checkpoint.async=true",
    ]
    res = train(over + [f"run.dir={tmp_path / 'a'}"], nproc=2, launcher="env")
    assert res.returncode == 0, res.stderr[-3000:]
    ck = tmp_path / "a" / "checkpoints"
    assert [p.name for p in sharded.committed(ck)] == ["step_00000002", "step_00000004", "step_00000006"]
    for p in sharded.committed(ck):
        sharded.verify(p)
        assert not list(p.glob("*.json"))[1:], "sidecars must be gone"  # only metadata.json remains
    assert (ck / "latest").read_text().strip() == "step_00000006"
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(ck / "step_00000004", tmp_path / "b" / "checkpoints" / "step_00000004")
    again = train(over + [f"run.dir={tmp_path / 'b'}"])
    assert again.returncode == 0, again.stderr[-3000:]
    for x, y in zip(metrics(tmp_path / "a")[4:], metrics(tmp_path / "b")):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"])


@pytest.mark.parametrize("zero", [0, 1])
def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path, zero):
    """lr=1e30 (finite, huge) blows the weights up after step 1: every later step has a NaN grad norm and
    is skipped; no checkpoint is committed while the last step was non-finite (a poisoned commit would be
    loaded again by every auto-resume), and after train.max_bad_steps in a row the run ends with one line
    naming the checkpoint to resume from."""
    res = train(
        [
            "data=synthetic",
            *TINY,
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "optim.clip_grad=0",
            f"optim.zero={zero}",
            "train.max_bad_steps=3",
            "train.max_steps=20",
            "train.log_interval=1",
            "checkpoint.interval=1",
            f"run.dir={tmp_path}",
        ]
    )
    assert res.returncode == 1, res.stderr[-2000:]
    ck = tmp_path / "checkpoints"
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("megaframe: error:")]
    assert len(err) == 1 and "4 steps in a row" in err[0] and "train.max_bad_steps=3" in err[0], res.stderr[
        -2000:
    ]
    assert f"resume with checkpoint.resume={ck / 'step_00000001'}" in err[0]
    assert res.stderr.count("skipped: non-finite grad norm") == 4
    assert res.stderr.count("not saving step") == 3  # steps 2-4 (step 5 stops the run first)
    from megaframe.checkpoint import sharded

    assert [p.name for p in sharded.committed(ck)] == ["step_00000001"]
    assert (ck / "latest").read_text().strip() == "step_00000001"
    meta = sharded.read_metadata(ck / "step_00000001")
    for key in meta["tensors"]:
        assert sharded.load_full(ck / "step_00000001", key, meta).isfinite().all(), key


def test_auto_resume_refuses_when_no_checkpoint_loads(tmp_path):
    """Every checkpoint fails to load (a flipped byte inside a tensor: sizes right, block checksum wrong):
    a failed load may have left part of the state overwritten, so resume=auto refuses (exit 2, one line)
    instead of starting "fresh" on mixed weights (before: it trained on from whatever the load left)."""
    over = ["data=synthetic", *TINY, "train.max_steps=2", "checkpoint.interval=2", f"run.dir={tmp_path}"]
    assert train(over).returncode == 0
    shard = tmp_path / "checkpoints" / "step_00000002" / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF  # in the last tensor's bytes: same size, so only the load's block check sees it
    shard.write_bytes(bytes(data))
    bad = train(over + ["train.max_steps=4"], timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "no checkpoint under" in bad.stderr and "could be loaded" in bad.stderr
