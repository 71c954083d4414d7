"""Run train.py / torchrun / prepare as a user would, in subprocesses with a hard timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
]


def env(gpu: bool = False, **extra) -> dict:
    """The command's environment. CPU only unless `gpu`: with train.device=auto on a GPU host, 2-4 torchrun
    ranks would share one GPU (NCCL does not support that) and the suite would not be the CPU suite."""
    e = dict(os.environ)
    e.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    e.update(extra)
    e.pop("MEGAFRAME_RUN_NAME", None)
    return e


def run(args: list[str], timeout: float = 300, gpu: bool = False, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, env=env(gpu, **extra_env), capture_output=True, text=True, timeout=timeout
    )


def train(
    overrides: list[str], nproc: int = 1, timeout: float = 300, **extra_env
) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "train.py",
        ]
    gpu = "train.device=cuda" in overrides  # the GPU tests (tests/gpu) ask for it by name
    return run(cmd + overrides, timeout=timeout, gpu=gpu, **extra_env)


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl lines, the later line winning for a step logged twice (after a restart)."""
    rows = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]
