"""Lost work end to end: the attempts at losing work through train.py and the tools, each a one-line
exit 2 (or the right checkpoint) where the code before lost work or used the wrong branch."""

import json
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import TINY, run, train

pytestmark = pytest.mark.e2e

SYN = ["data=synthetic", *TINY, "train.log_interval=1", "logging.wandb.mode=disabled"]


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megaframe: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_a_checkpoint_dir_owned_by_a_live_job_is_refused_before_any_step(tmp_path):
    """L1: two jobs with their own run.dir and one checkpoint.dir both exited 0, the second replacing
    every checkpoint of the first."""
    shared = tmp_path / "shared_ck"
    shared.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (shared / "megaframe.lock").write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid, "job": "", "since": time.time()})
        )
        res = train(
            SYN + ["train.max_steps=2", f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={shared}"], timeout=120
        )
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr[-2000:]
    assert (
        f"checkpoint.dir={shared} is in use by another run (host {socket.gethostname()}, pid {holder.pid}"
        in _error_line(res.stderr)
    )
    assert sorted(p.name for p in shared.iterdir()) == ["megaframe.lock"]  # no step folder, no `latest`
    assert not (tmp_path / "b" / "megaframe.lock").exists()  # its own run.dir lock given back


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory, demo_prepared):
    """Run A trains 8 steps saving 2,4,6,8; a rollback B resumes from 2 and saves 3 and 6 (a step number
    A's abandoned branch has). Returns (checkpoint dir, A's step-6 lineage, B's result)."""
    root = tmp_path_factory.mktemp("rb")
    common = [*TINY, f"data.path={demo_prepared}", "logging.wandb.mode=disabled", f"run.dir={root / 'run'}"]
    a = train(common + ["train.max_steps=8", "checkpoint.interval=2"])
    assert a.returncode == 0, a.stderr[-2000:]
    ck = root / "run" / "checkpoints"
    a6 = _lineage(ck / "step_00000006")
    b = train(
        common + ["train.max_steps=6", "checkpoint.interval=3", f"checkpoint.resume={ck / 'step_00000002'}"]
    )
    assert b.returncode == 0, b.stderr[-2000:]
    return ck, a6, b


def _lineage(step) -> dict:
    return json.loads((step / "metadata.json").read_text())["lineage"]


def test_a_rollback_reaching_a_step_of_the_abandoned_branch_keeps_that_checkpoint(rolled_back):
    """F6: the rollback's step_00000006 replaced A's (rmtree), though other branches are never deleted."""
    ck, a6, b = rolled_back
    kept = sorted(ck.glob("step_00000006.replaced-*"))
    assert len(kept) == 1 and _lineage(kept[0]) == a6, sorted(p.name for p in ck.iterdir())
    # one readable sentence: which folder held whose checkpoint, and its new name
    assert (
        f"warning: {ck / 'step_00000006'} held another branch's checkpoint (run {a6['run_id']}, parent "
        in b.stderr
        and f"; renamed it {kept[0].name}" in b.stderr
    ), b.stderr[-2000:]
    assert (ck / "latest").read_text().strip() == "step_00000006"
    assert _lineage(ck / "step_00000006")["run_id"] != a6["run_id"]


@pytest.mark.parametrize("tool", ["generate", "evaluate", "export_hf"])
def test_tools_on_the_checkpoint_dir_use_the_rollbacks_branch(rolled_back, tool, tmp_path):
    """W1: generate, evaluate and export_hf on the dir reported the abandoned step_00000008."""
    ck, _, _ = rolled_back
    cmd = {
        "generate": ["-m", "megaframe.generate", str(ck), "--prompt", "The", "--max-new-tokens", "2"],
        "evaluate": ["-m", "megaframe.evaluate", str(ck), "train.eval_iters=1"],
        "export_hf": ["scripts/export_hf.py", str(ck), str(tmp_path / "hf")],
    }[tool]
    res = run([sys.executable, *cmd], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    said = (res.stdout + res.stderr).splitlines()
    named = [
        ln for ln in said if ln.startswith(("generate:", "evaluate:", "export:")) and "checkpoints" in ln
    ][0]
    assert f"{ck / 'step_00000006'}" in named and "step_00000008" not in named, named


@pytest.mark.parametrize("out", ["step_00000006", ".", ".."])
def test_export_hf_force_onto_its_own_checkpoint_is_refused(rolled_back, out):
    """L3: `export_hf STEP STEP --force` deleted the committed checkpoint."""
    ck, _, _ = rolled_back
    step = ck / "step_00000006"
    before = sorted(p.name for p in step.iterdir())
    res = run([sys.executable, "scripts/export_hf.py", str(step), str(step / out), "--force"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "overlaps the checkpoint it exports" in _error_line(res.stderr)
    assert sorted(p.name for p in step.iterdir()) == before


def test_resume_auto_with_a_garbage_latest_over_two_branches_exits_2(rolled_back, tmp_path):
    """W2: a garbage `latest` resumed the abandoned branch's highest step without a word."""
    import shutil

    ck, _, _ = rolled_back
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy, ignore=shutil.ignore_patterns("megaframe.lock"))
    (copy / "latest").write_text("garbage\n")
    res = train(
        [
            *TINY,
            "data=synthetic",
            f"run.dir={tmp_path / 'run'}",
            f"checkpoint.dir={copy}",
            "train.max_steps=10",
        ],
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    line = _error_line(res.stderr)
    assert "checkpoint.resume=auto" in line and "branches" in line and "resumed from" not in res.stdout


def test_a_save_past_its_time_limit_fails_that_save_and_keeps_the_previous(tmp_path):
    """Open item: the watchdog ended such a run with 124 (a "hang"), naming nothing to resume from."""
    res = train(
        SYN
        + [
            "train.max_steps=3",
            "checkpoint.interval=1",
            "train.hang_timeout_s=30",
            "checkpoint.save_timeout_s=1",
            f"run.dir={tmp_path}",
        ],
        timeout=180,
        MEGAFRAME_INJECT="slow_save:step=2:seconds=8",
    )
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    ck = tmp_path / "checkpoints"
    assert last == (
        f"megaframe: error: checkpoint step 2 not committed: the save took longer than "
        f"checkpoint.save_timeout_s=1s; the last committed checkpoint, {ck / 'step_00000001'}, is intact"
    )
    assert (ck / "latest").read_text().strip() == "step_00000001" and not (ck / "step_00000002").exists()


def test_generate_checks_every_prompt_before_writing_any(rolled_back):
    """K10: a prompt over seq_length aborted the prompts after it, after the earlier ones' output."""
    ck, _, _ = rolled_back
    res = run(
        [
            sys.executable,
            "-m",
            "megaframe.generate",
            str(ck),
            "--prompt",
            "The",
            "--prompt",
            "word " * 100,
            "--max-new-tokens",
            "2",
        ],
        timeout=300,
    )
    assert res.returncode == 2 and res.stdout == "", res.stderr[-2000:]
    assert "prompt 2 of 2 has" in _error_line(res.stderr)


def test_another_runs_checkpoint_dir_is_continued_only_when_asked(rolled_back, demo_prepared, tmp_path):
    """A second run with its own run.dir and the first's checkpoint.dir resumed the first's checkpoints
    (resume=auto) without a word. (The same run's restarts: every resume=auto test in the suite.)"""
    import shutil

    src, _, _ = rolled_back
    ck = tmp_path / "shared_ck"  # a copy: the fixture's folder stays as the other tests read it
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("megaframe.lock"))
    common = [
        *TINY,
        f"data.path={demo_prepared}",
        "logging.wandb.mode=disabled",
        f"run.dir={tmp_path / 'b'}",
        f"checkpoint.dir={ck}",
        "train.max_steps=7",
    ]
    res = train(common, timeout=180)
    assert res.returncode == 2, res.stderr[-2000:]
    line = _error_line(res.stderr)
    assert f"checkpoint.dir={ck}: its newest checkpoint step_00000006 belongs to another run" in line, line
    assert f"checkpoint.resume={ck}" in line and "resumed from" not in res.stdout
    assert (ck / "latest").read_text().strip() == "step_00000006"  # nothing written there
    asked = train(common + [f"checkpoint.resume={ck}"], timeout=180)  # on purpose: the folder's `latest`
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert f"resumed from {ck / 'step_00000006'} at step 6" in asked.stdout
    assert _lineage(ck / "step_00000007")["run_dir"] == str(tmp_path / "b")
