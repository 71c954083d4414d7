"""pretrain.sbatch's defaults are safe for a long multi-node job, checked without Slurm: the script runs as
far as its launch under a fake `srun`/`scontrol`, and the container recipe has every dependency."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.slurm.helpers import ROOT, SBATCH_SCRIPT

DOCKERFILE = ROOT / "scripts" / "slurm" / "Dockerfile"
FAKE = {
    # `scontrol show hostnames` names this host; `show job`/`show node`/`requeue` say nothing
    "scontrol": '[[ "$1 $2" == "show hostnames" ]] && echo localhost; exit 0',
    # the launch: record the arguments train.py would get, one per line
    "srun": 'printf "%s\\n" "$@" > "$SRUN_ARGS"; exit 0',
}


def _launch_args(tmp_path: Path, overrides: list[str]) -> list[str]:
    """The arguments the job passes to srun (train.py's overrides among them), as shipped."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in FAKE.items():
        (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGAFRAME_", "SRUN_"))}
    env.update(
        PATH=f"{bindir}:{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="mf",
        SLURM_NTASKS="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_CPUS_PER_TASK="8",
        MEGAFRAME_ROOT=str(ROOT),
        SRUN_ARGS=str(tmp_path / "srun.args"),
        WANDB_MODE="disabled",
    )
    res = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (tmp_path / "srun.args").is_file(), res.stdout + res.stderr
    return (tmp_path / "srun.args").read_text().splitlines()


def _last(args: list[str], key: str) -> str:
    """The value train.py takes for `key`: the last override of it wins (Hydra)."""
    return [a.split("=", 1)[1] for a in args if a.startswith(f"{key}=")][-1]


def test_sbatch_saves_by_step_and_by_time_keeps_a_bounded_number_and_the_user_overrides_win(tmp_path):
    args = _launch_args(tmp_path, ["data=synthetic", "checkpoint.keep_last=5"])
    assert int(_last(args, "checkpoint.interval")) > 0, args  # before: 0 (a node crash lost the whole job)
    assert float(_last(args, "checkpoint.interval_minutes")) > 0, args
    assert _last(args, "checkpoint.keep_last") == "5", args  # the user's value, given after the defaults
    from megaframe.config import load_config

    cfg = load_config([a for a in args if "=" in a and not a.startswith("-")], world_size=1)
    assert (
        cfg.checkpoint.interval > 0 and cfg.checkpoint.interval_minutes > 0 and cfg.checkpoint.keep_last == 5
    )


def test_sbatch_asks_for_cpus_per_rank_and_a_signal_lead_for_a_save():
    text = SBATCH_SCRIPT.read_text()
    # on the documented GPU command line: the script itself names no layout a CPU cluster would refuse
    assert re.search(r"^#   sbatch .*--cpus-per-task=\d+", text, re.M)
    assert "SRUN_CPUS_PER_TASK" in text
    lead = int(re.search(r"^#SBATCH --signal=USR1@(\d+)", text, re.M).group(1))
    assert lead >= 600  # 10 steps to the next stop check at ~16 s/step (llama3_8b) plus the save
    for key in ("partition", "account", "qos"):
        assert re.search(rf"^##SBATCH --{key}=", text, re.M), key


def test_container_recipe_installs_every_dependency_on_an_ngc_pytorch_image():
    text = DOCKERFILE.read_text()
    assert "scripts/slurm/Dockerfile" in SBATCH_SCRIPT.read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S*nvidia/pytorch:\S+$", text, re.M) and "FROM ${BASE_IMAGE}" in text
    pip = re.search(r"^RUN pip install --no-cache-dir (.*?)(?<!\\)$", text, re.M | re.S).group(1)
    names = {re.split(r"[<>=\[ ]", w.strip('"'))[0].lower() for w in pip.replace("\\\n", " ").split()}
    block = re.search(
        r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S
    ).group(1)
    deps = re.findall(r'"([^"]+)"', block)  # (tomllib is Python >= 3.11; the project supports 3.10)
    wanted = {re.split(r"[<>=\[ ]", d)[0].lower() for d in deps} - {"torch"}  # the image's CUDA torch stays
    assert wanted | {"torchao"} <= names, sorted(wanted | {"torchao"} - names)
    assert "--no-deps -e /opt/megaframe" in text  # pip must not replace NGC's torch with the pinned CPU build
