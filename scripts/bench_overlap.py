"""A forward beside a backward (parallel.pp_schedule=1f1b_overlap) against the plain 1f1b, on this
machine's gloo ranks: the same MoE run launched with each kind, alternately, and the ratio of their
training tokens/s (the run summary's mean, evaluation and start-up excluded).

    python scripts/bench_overlap.py                       # 2 ranks, ep2, 3 launches of each kind
    python scripts/bench_overlap.py --ranks 4 --repeats 1 -- parallel.tp=2 parallel.sp=true

Prints one line per launch and `overlap / plain tokens/s: R (median of N pairs)`. On a CPU the two threads
share the cores with gloo's own; the figure says whether a wait on one lane lets the other compute here, not
what an H100 gains (NCCL's kernels there take SMs from the compute beside them).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "model=moe_tiny",
    "data=synthetic",
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.seq_length=256",
    "train.global_batch_size=32",
    "train.micro_batch_size=2",
    "train.max_steps=6",
    "optim.warmup_steps=1",
    "train.log_interval=6",
    "checkpoint.interval=0",
]
SPEED = re.compile(r"\(([\d,]+) tokens/s mean")


def launch(ranks: int, kind: str, extra: list[str], workdir: str) -> float:
    """Training tokens/s of one run of `kind` (torchrun, gloo on this machine)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        str(ROOT / "train.py"),
        *RUN,
        f"parallel.ep={ranks}",
        f"parallel.pp_schedule={kind}",
        f"run.dir={workdir}/{kind}",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), timeout=900)
    found = SPEED.search(out.stdout)
    if out.returncode or not found:
        raise SystemExit(f"bench_overlap: {kind} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return float(found.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="more overrides for both kinds (after --)")
    a = ap.parse_args(argv)
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            # alternated, so a machine that slows over the run costs both kinds alike
            plain = launch(a.ranks, "1f1b", a.extra, f"{tmp}/{i}")
            over = launch(a.ranks, "1f1b_overlap", a.extra, f"{tmp}/{i}")
            ratios.append(over / plain)
            speeds = f"1f1b {plain:,.0f} tokens/s, 1f1b_overlap {over:,.0f} tokens/s"
            print(f"launch {i + 1}: {speeds} ({ratios[-1]:.3f})")
    print(f"overlap / plain tokens/s: {statistics.median(ratios):.3f} (median of {len(ratios)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
