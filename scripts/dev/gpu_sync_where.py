"""Where does a training step make the host wait for the GPU? One H100 run, about a minute.

    python scripts/dev/gpu_sync_where.py [--steps 3] [overrides...]
    python scripts/dev/gpu_sync_where.py --dry      # CPU, tiny sizes, no sync mode: checks the script itself

A probe counting sync-debug warnings per step (dense model, real tokens) counted syncs per step
[1, 0] after a warm-up step on a llama-like model at 8192 tokens: step 2 synchronised once, step 3 not.
CPU counting (tests/distributed/sync_count.py) sees nothing in those steps, so the sync is a CUDA-only
one. This prints, for every counted step, each sync-debug warning with the Python stack that raised it
(and every other warning, since the probe counted any message mentioning "synchroniz"); a sync raised
inside backward then shows the backward call, so a second pass re-runs the first syncing step under
sync_debug_mode("error") with anomaly detection, whose error names the forward op of the node.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LLAMA_LIKE = [
    "model=llama3_8b",
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=1024",
    "model.num_attention_heads=8",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=3584",
    "model.vocab_size=128256",
    "model.seq_length=8192",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    "train.device=cuda",
    "train.precision=bf16",
    "optim.warmup_steps=0",
]
DRY = [
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.vocab_size=512",
    "model.seq_length=256",
    "train.device=cpu",
]
DEVICE = "cuda"


def _sync_mode(mode: str) -> None:
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def set_up(overrides: list[str], steps: int):
    from megaframe.config import load_config
    from megaframe.data.dataset import BatchShape, microbatches
    from megaframe.model.parallelize import build_for
    from megaframe.parallel.mesh import single_process_mesh
    from megaframe.training.startup import run_samples

    cfg = load_config(LLAMA_LIKE + overrides, world_size=1, check_data=False)
    mesh = single_process_mesh(DEVICE)
    model, opt = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    t, data = cfg.train, run_samples(cfg)
    batches = [
        microbatches(data, s, BatchShape(t.global_batch_size, t.micro_batch_size, t.seed), mesh)
        for s in range(steps)
    ]
    return cfg, mesh, model, opt, batches


def _recorder(caught: list):
    def hook(message, category, filename, lineno, file=None, line=None):
        # the stack of the Python frame that made the sync (forward, optimizer), or backward()
        caught.append(
            (category.__name__, str(message), f"{filename}:{lineno}", traceback.format_stack(limit=14)[:-1])
        )

    return hook


def run(overrides: list[str], steps: int, error_at: int | None = None) -> int | None:
    """Steps 1..steps; step 1 uncounted. Returns the first step with a sync warning."""
    from megaframe.config.derived import derive
    from megaframe.training.step import optimizer_step

    cfg, mesh, model, opt, batches = set_up(overrides, steps)
    first = None
    for step in range(1, steps + 1):
        if step == 1:
            optimizer_step(model, opt, batches[0], mesh, cfg.optim, derive(cfg, 1), 1)
            _synchronize()
            continue
        if step == error_at:
            _sync_mode("error")
            try:
                with torch.autograd.detect_anomaly(check_nan=False):
                    optimizer_step(model, opt, batches[step - 1], mesh, cfg.optim, derive(cfg, 1), step)
                print(f"step {step}: no sync under error mode")
            except RuntimeError:
                print(f"step {step}: the sync, under error mode with anomaly detection:")
                traceback.print_exc()
            finally:
                _sync_mode("default")
            return first
        caught: list = []
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = _recorder(caught)
            _sync_mode("warn")
            try:
                optimizer_step(model, opt, batches[step - 1], mesh, cfg.optim, derive(cfg, 1), step)
            finally:
                _sync_mode("default")
        _synchronize()
        print(f"=== step {step}: {len(caught)} warning(s)")
        for category, message, where, stack in caught:
            print(f"--- {category}: {message[:200]} ({where})\n{''.join(stack)}")
            if "synchroniz" in message and first is None:
                first = step
    return first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dry", action="store_true")
    args, overrides = ap.parse_known_args()
    if args.dry:
        global DEVICE
        DEVICE, overrides = "cpu", DRY + overrides
    first = run(overrides, args.steps)
    if first is not None:
        run(overrides, first, error_at=first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
