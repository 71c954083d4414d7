"""Run train.py / torchrun / prepare as a user would, in subprocesses with a hard timeout."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
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
    overrides: list[str], nproc: int = 1, timeout: float = 300, launcher: str = "torchrun", **extra_env
) -> subprocess.CompletedProcess:
    """train.py at `nproc` ranks. launcher="env" starts the ranks directly with RANK / WORLD_SIZE /
    LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, as srun does (see megaframe/parallel/launch.py): no torchrun
    agent (about 2 s of CPU and 1.5 s of wall per launch), for tests whose subject is not the launcher."""
    gpu = "train.device=cuda" in overrides  # the GPU tests (tests/gpu) ask for it by name
    if nproc > 1 and launcher == "env":
        return _train_env_ranks(overrides, nproc, timeout, gpu, extra_env)
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
    return run(cmd + overrides, timeout=timeout, gpu=gpu, **extra_env)


def _free_port() -> int:
    """A port below Linux's ephemeral range (32768-60999): no other process's outgoing connection takes it
    between this check and rank 0 binding it."""
    for _ in range(100):
        port = random.randint(12000, 31999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 12000-31999")


def _train_env_ranks(overrides, nproc, timeout, gpu, extra_env) -> subprocess.CompletedProcess:
    """Each rank's stdout and stderr, rank 0 first; the exit code is the largest of the ranks' (srun's).
    When a rank fails, the others get 20 s to end on their own (they usually fail the same collective),
    then are killed, as srun --kill-on-bad-exit does: a survivor would otherwise wait out the dist timeout."""
    port = str(_free_port())
    procs, files = [], []
    for rank in range(nproc):
        ranks = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        ranks.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        files.append((out, err))
        e = env(gpu, **ranks, **extra_env)
        cmd = [sys.executable, "train.py", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=out, stderr=err, text=True))
    deadline, killed_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(["train.py", *overrides], timeout)
            if killed_at is None and any(p.returncode for p in procs):
                killed_at = now + 20
            if killed_at is not None and now > killed_at:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    code = max(procs, key=lambda p: abs(p.returncode)).returncode
    return subprocess.CompletedProcess(
        ["train.py", *overrides], code, "".join(o for o, _ in texts), "".join(e for _, e in texts)
    )


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl lines, the later line winning for a step logged twice (after a restart)."""
    rows = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]
