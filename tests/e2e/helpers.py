"""Run train.py / torchrun / prepare as a user would, in subprocesses with a hard timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.seq_length=32", "train.global_batch_size=8",
        "train.micro_batch_size=2", "optim.warmup_steps=2", "optim.lr=3e-3"]


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra)
    e.pop("MEGAFRAME_RUN_NAME", None)
    return e


def run(args: list[str], timeout: float = 300, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)


def train(overrides: list[str], nproc: int = 1, timeout: float = 300, **extra_env) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "train.py"]
    return run(cmd + overrides, timeout=timeout, **extra_env)


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl lines, the later line winning for a step logged twice (after a restart)."""
    rows = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]
