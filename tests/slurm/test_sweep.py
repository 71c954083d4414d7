"""scripts/slurm/sweep.py: Hydra sweep overrides -> one pretrain.sbatch job per point."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.e2e.helpers import TINY
from tests.slurm.helpers import ROOT, SBATCH_SCRIPT, job_env, tail, wait_done

SWEEP = ROOT / "scripts" / "slurm" / "sweep.py"


def _sweep_module():
    spec = importlib.util.spec_from_file_location("megaframe_slurm_sweep", SWEEP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_expand_is_hydra_multirun_order():
    expand = _sweep_module().expand
    points = expand(
        ["optim.lr=1e-3,3e-3", "model=gpt_tiny,gpt2_tiny", "train.max_steps=5", "train.seed=range(1,3)"]
    )
    assert len(points) == 8
    assert points[0] == ["optim.lr=0.001", "model=gpt_tiny", "train.max_steps=5", "train.seed=1"]
    assert points[1] == ["optim.lr=0.001", "model=gpt_tiny", "train.max_steps=5", "train.seed=2"]
    assert points[-1] == ["optim.lr=0.003", "model=gpt2_tiny", "train.max_steps=5", "train.seed=2"]
    assert expand(["train.max_steps=5"]) == [["train.max_steps=5"]]


def test_dry_run_prints_one_sbatch_per_point_and_bad_syntax_exits_2():
    res = subprocess.run(
        [
            sys.executable,
            str(SWEEP),
            "--dry-run",
            "--name",
            "sw",
            "optim.lr=1e-3,3e-3",
            "data=synthetic",
            "--",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--time=5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and all(
        "--job-name=sw-" in ln and "--nodes=1 --ntasks-per-node=2 --time=5" in ln for ln in lines
    )
    assert lines[1].endswith("pretrain.sbatch optim.lr=0.003 data=synthetic")
    bad = subprocess.run(
        [sys.executable, str(SWEEP), "--dry-run", "optim.lr=interval(0,1)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "interval" in bad.stderr


@pytest.mark.parametrize(
    "point,flags,needle",
    [
        (
            ["optim.lrr=1e-3,3e-3"],
            ["--ntasks=1"],
            "point 0 (data=synthetic optim.lrr=0.001) on 1 ranks: optim.lrr=0.001: optim.lrr is not",
        ),
        (
            ["optim.lr=1e-3", "parallel.tp=1,3"],
            ["--nodes=1", "--ntasks-per-node=2"],
            "point 1 (data=synthetic optim.lr=1e-3 parallel.tp=3) on 2 ranks: "
            "parallel.tp=3 x parallel.pp=1 does not divide "
            "the world size 2",
        ),
        # 8 ranks, batch 16 of micro 4
        (["optim.lr=1e-3"], ["--ntasks=8"], "on 8 ranks: train.global_batch_size=16 is not divisible"),
        (["optim.zero=5"], [], "optim.zero=5 must be <= 3"),
    ],
    ids=["unknown-key", "tp-on-world", "batch-on-world", "value"],
)
def test_an_invalid_point_exits_2_before_any_submission(point, flags, needle, tmp_path):
    """Before: each point was submitted, waited in the queue and failed at the job's pre-flight. The sbatch
    here fails loudly if called: nothing may be submitted, not even the valid points before the bad one."""
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/bash\ntouch {tmp_path / 'called'}\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(
        [sys.executable, str(SWEEP), "data=synthetic", *point, "--", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "nothing submitted" in res.stderr and not res.stdout
    assert not (tmp_path / "called").exists()


def test_the_world_size_of_a_point_comes_from_the_sbatch_flags():
    mod = _sweep_module()
    assert mod.world_size(["--ntasks=6"]) == 6
    assert mod.world_size(["--nodes", "2", "--ntasks-per-node=4"]) == 8
    assert mod.world_size(["--nodes=3"]) is None  # the script sets no task layout: any size is checked
    assert mod.world_size(["--nodes=2-4", "--ntasks-per-node=4"]) is None  # a range: sbatch decides


@pytest.mark.slurm
@pytest.mark.e2e
def test_a_request_no_partition_can_hold_fails_at_submission(slurm_cluster, tmp_path):
    """More CPUs per task than a node has (the local nodes have 4): refused by sbatch --test-only before any
    job is queued, instead of a job pending for ever."""
    res = subprocess.run(
        [
            sys.executable,
            str(SWEEP),
            "--name",
            "mf-toobig",
            "data=synthetic",
            *TINY,
            "train.max_steps=2",
            "--",
            "--ntasks=1",
            "--cpus-per-task=64",
        ],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "no partition can run" in res.stderr, res.stderr
    queued = subprocess.run(["squeue", "-h", "-n", "mf-toobig-0"], capture_output=True, text=True).stdout
    assert not queued.strip() and not res.stdout


@pytest.mark.slurm
@pytest.mark.e2e
def test_the_plain_documented_command_is_accepted_by_a_cpu_cluster(slurm_cluster, tmp_path):
    """docs/slurm.md's CPU command on the local (GPU-less) cluster, asked with --test-only (nothing queued).
    Before: "Invalid generic resource (gres) specification" from the script's own --gpus-per-node=8."""
    res = subprocess.run(
        ["sbatch", "--test-only", "--nodes=2", "--time=00:10:00", "--signal=USR1@60", str(SBATCH_SCRIPT)]
        + ["data=synthetic", "train.max_steps=6"],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.slurm
@pytest.mark.e2e
def test_sweep_submits_one_job_per_point_with_its_own_run(slurm_cluster, tmp_path):
    tiny = [o for o in TINY if not o.startswith("optim.lr=")]
    res = subprocess.run(
        [
            sys.executable,
            str(SWEEP),
            "--name",
            "mf-sweep",
            "optim.lr=1e-3,3e-3",
            "data=synthetic",
            *tiny,
            "train.max_steps=2",
            "logging.wandb.mode=disabled",
            "--",
            "--ntasks=1",
            "--time=15",
        ],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    jobs = [line.split("\t") for line in res.stdout.splitlines()]
    assert [j[0] for j in jobs] == ["0", "1"] and jobs[0][2] != jobs[1][2]
    for (idx, job, name, _), lr in zip(jobs, (0.001, 0.003)):
        out = tmp_path / f"mf-sweep-{idx}-{job}.out"
        info = wait_done(int(job), 180, out)
        assert info["JobState"] == "COMPLETED", f"{info}\n{tail(out)}"
        cfg = yaml.safe_load((tmp_path / "outputs" / name / "config.yaml").read_text())
        assert cfg["optim"]["lr"] == lr and cfg["run"]["name"] == name
        assert (tmp_path / "outputs" / name / "metrics.jsonl").read_text().count("\n") >= 1


def test_pretrain_sbatch_runs_on_gpu_and_cpu_clusters():
    """The shipped script asks for no GPUs and no task layout (a CPU cluster refuses any GPU request:
    "Invalid generic resource (gres) specification"); the GPU path is documented as sbatch flags, and the
    network / allocator settings are in (needs no Slurm: runs everywhere)."""
    text = SBATCH_SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH_SCRIPT)]).returncode == 0
    directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH ")]
    assert not [ln for ln in directives if re.search(r"gpu|gres|exclusive|ntasks|cpus-per-task", ln)]
    for needle in (
        "--gpus-per-node=8 --ntasks-per-node=8 --cpus-per-task=8 --exclusive",
        "SBATCH_GPUS_PER_NODE=8",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}",
        "--container-image=",
        "MEGAFRAME_SETUP",
    ):
        assert needle in text, needle
    doc = (ROOT / "docs" / "slurm.md").read_text()
    assert "--gpus-per-node=8 --ntasks-per-node=8 --cpus-per-task=8 --exclusive" in doc


def test_a_folder_given_for_the_whole_sweep_becomes_each_points_parent(capsys):
    """Before: every point got run.dir=<the given folder>; run one after another, point 1 resumed point 0's
    checkpoint and trained nothing, exit 0. A shared checkpoint.dir the same."""
    mod = _sweep_module()
    base = ["--dry-run", "--name", "sw", "optim.lr=1e-3,3e-3", "data=synthetic"]
    assert mod.main([*base, "run.dir=runs/lr", "--", "--ntasks=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[-1] for ln in lines] == ["run.dir=runs/lr/0", "run.dir=runs/lr/1"], lines
    assert mod.main([*base, "checkpoint.dir=/ck", "--", "--ntasks=1"]) == 0
    assert [ln.split()[-1] for ln in capsys.readouterr().out.splitlines()] == [
        "checkpoint.dir=/ck/0",
        "checkpoint.dir=/ck/1",
    ]
    # one value per point is the user's own choice: kept
    assert mod.main([*base[:-2], "run.dir=runs/a,runs/b", "data=synthetic", "--", "--ntasks=1"]) == 0
    assert [ln.split()[-2] for ln in capsys.readouterr().out.splitlines()] == [
        "run.dir=runs/a",
        "run.dir=runs/b",
    ]


def test_points_that_would_still_share_a_run_folder_are_refused(capsys):
    mod = _sweep_module()
    code = mod.main(
        ["--dry-run", "optim.lr=1e-3,3e-3", "data=synthetic", "run.name=fixed", "--", "--ntasks=1"]
    )
    err = capsys.readouterr()
    assert code == 2 and not err.out, err
    assert err.err.count("\n") == 1 and "point 1" in err.err and "run.dir=outputs/fixed as point 0" in err.err


def test_script_names_the_job_script_every_point_is_submitted_with(tmp_path, capsys):
    mod = _sweep_module()
    site = tmp_path / "site.sbatch"
    site.write_text("#!/bin/bash\n#SBATCH --ntasks-per-node=2\n")
    # an option among the overrides is an option, not an override
    assert mod.main(["--dry-run", "optim.lr=1e-3,3e-3", "--script", str(site), "data=synthetic"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(f" {site} " in ln for ln in lines), lines
    # its #SBATCH lines give the world size: tp=3 does not divide 2 ranks
    assert mod.main(["--dry-run", "--script", str(site), "data=synthetic", "parallel.tp=3"]) == 2
    assert "on 2 ranks" in capsys.readouterr().err
    assert mod.main(["--dry-run", "--script", str(tmp_path / "nope"), "data=synthetic"]) == 2
    assert "--script" in capsys.readouterr().err
