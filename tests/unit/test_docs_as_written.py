"""The docs harness (tests/e2e/docs_commands.py) runs a refusal the page shows ([exit N]) exactly as a user
types it: an appended setting once made a refusal true in the suite that a user never saw. And the folders
the docs' commands prepare under data/ are ignored by git, like runs/ and outputs/."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.e2e.docs_commands import PAGES, ROOT, commands, small_overrides


def test_exit_lines_run_as_written():
    refusals = [c for p in PAGES for c in commands(p) if c.runs and c.expected_exit]
    assert len(refusals) >= 4
    for c in refusals:
        assert small_overrides(c) == [], f"{c.where}: `{c.code}` would run with {small_overrides(c)}"
    # a plain train command still gets the tiny model (the journey stays fast)
    plain = next(c for c in commands("README.md") if c.runs and "run.dir=runs/a" in c.code)
    assert "model.hidden_size=64" in small_overrides(plain)


def test_the_batch_refusal_differs_from_the_default_batch():
    """docs/checkpoints.md's refusal is of a batch other than the checkpoint's: written as the default (16)
    it resumed and trained for a user, and was refused only under the harness's batch of 8."""
    from megaframe.config import load_config

    default = load_config(["data=synthetic"], world_size=1, check_data=False).train.global_batch_size
    [line] = [c for c in commands("docs/checkpoints.md") if c.expected_exit == 2]
    batch = int(re.search(r"train\.global_batch_size=(\d+)", line.code).group(1))
    assert batch not in (default, 8), line.code  # 8: the batch the harness gave runs/b


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_folders_the_docs_prepare_are_ignored():
    folders = sorted(
        {
            m
            for p in PAGES
            for c in commands(p)
            if c.runs
            for m in re.findall(r"data\.path=(data/[\w.-]+)", c.code)
        }
    )
    assert "data/code" in folders and "data/alice" in folders
    res = subprocess.run(["git", "check-ignore", *folders], cwd=ROOT, capture_output=True, text=True)
    assert sorted(res.stdout.split()) == folders, res.stdout
    kept = subprocess.run(["git", "check-ignore", "data/demo/corpus/x.txt.gz"], cwd=ROOT, capture_output=True)
    assert kept.returncode == 1  # the demo corpus stays tracked


def train_commands():
    """(command, its overrides) of every train command of the pages that trains (not --cfg, not a refusal)."""
    from tests.e2e.docs_commands import hydra_overrides

    for page in PAGES:
        for c in commands(page):
            tool, over = hydra_overrides(c)
            if tool == "train.py" and not c.expected_exit and "--cfg" not in c.code:
                yield c, dict(o.lstrip("+").split("=", 1) for o in over)


def test_every_train_command_sets_its_own_short_run_without_lr_warnings():
    """A reader copying a command gets a run of the length the page means, not the default 300 steps
    (minutes on CPU, the suite's cap hid it), and a warmup shorter than it: no "ends inside the warmup"
    or "warmup >= decay horizon" warnings on the short run."""
    from types import SimpleNamespace

    from megaframe.config import load_config
    from megaframe.optim.lr_schedule import schedule_warnings

    base = load_config(["data=synthetic"], world_size=1, check_data=False).optim
    checked = 0
    for c, keys in train_commands():
        assert "train.max_steps" in keys, f"{c.where}: `{c.code}` runs the default 300 steps"
        steps = int(keys["train.max_steps"])
        warmup = int(keys.get("optim.warmup_steps", base.warmup_steps))
        optim = SimpleNamespace(**{**vars(base), "warmup_steps": warmup})
        assert schedule_warnings(optim, steps) == [], f"{c.where}: `{c.code}`"
        checked += 1
    assert checked >= 30


def test_the_readme_resume_logs_steps_both_runs_hold():
    """README's "same losses" claim is visible as written: the first run (to step 4) and the one resumed
    at its step 2 (to step 6) log a common step (a metrics line at step 1, every log_interval, the last)."""
    runs = {k["run.dir"]: k for c, k in train_commands() if c.page == "README.md" and "run.dir" in k}
    a, b = runs["runs/a"], runs["runs/b"]

    def logged(first: int, keys: dict) -> set[int]:
        last, every = int(keys["train.max_steps"]), int(keys.get("train.log_interval", 25))
        return {s for s in range(first, last + 1) if s == 1 or s % every == 0 or s == last}

    resumed_at = int(b["checkpoint.resume"].rsplit("step_", 1)[1])
    assert logged(1, a) & logged(resumed_at + 1, b) == {3, 4}
