"""What a training process imports: a run that does not compile never loads the compiler (torch._dynamo and
inductor cost about as much CPU as torch itself, in every rank of every run), and the job script's helper that
checks a config never loads torch at all."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.helpers import ROOT, TINY, run, train

pytestmark = pytest.mark.e2e


def test_a_dp2_run_without_compile_never_imports_the_compiler(tmp_path):
    """dp=2 takes ZeRO's path: AdamW over owned ranges and the weight-grad op into main_grad
    (layers/wgrad.py), each of which imported torch._dynamo through torch's lazy guards.
    PYTHONPROFILEIMPORTTIME makes every process (torchrun's agent and both ranks) list each module it imports
    on stderr."""
    res = train(
        ["data=synthetic", *TINY, "train.max_steps=2", f"run.dir={tmp_path}"],
        nproc=2,
        PYTHONPROFILEIMPORTTIME="1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    imported = _imported(res.stderr)
    assert {"torch", "megaframe.layers.wgrad", "megaframe.optim.zero"} <= imported
    assert not {"torch._dynamo", "torch._inductor"} & imported


def _imported(stderr: str) -> set[str]:
    return {ln.rsplit("|", 1)[1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")}


def test_the_job_scripts_config_check_imports_no_torch():
    """scripts/slurm/run_info.py runs twice per job start (and per requeued start) before any rank: it
    composes and checks the config, RoPE scaling's rules included, in well under torch's import time."""
    res = run(
        [
            sys.executable,
            str(ROOT / "scripts" / "slurm" / "run_info.py"),
            "--world-size",
            "4",
            "data=synthetic",
            "model.rope_scaling.rope_type=linear",
            "model.rope_scaling.factor=2.0",
        ],
        timeout=60,
        PYTHONPROFILEIMPORTTIME="1",
    )
    assert res.returncode == 0 and "MAX_STEPS=" in res.stdout, res.stderr[-2000:]
    imported = _imported(res.stderr)
    assert {"megaframe.config.checks", "megaframe.model.rope_checks"} <= imported
    assert "torch" not in imported
