"""What pretrain.sbatch needs to know about a run, as shell assignments (no torch import, ~1 s).

    python scripts/slurm/run_info.py --world-size N [hydra overrides]

composes the config exactly as train.py would (same overrides, same $MEGAFRAME_RUN_NAME), checks it
for N ranks, and prints RUN_DIR, CKPT_DIR (absolute), MAX_STEPS and LATEST_STEP (the step of the
newest committed checkpoint named by ${checkpoint.dir}/latest, 0 when there is none). A bad config
prints `megaframe: error: ...` and exits 2, so the job script stops before starting any rank.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def latest_step(ckpt_dir: Path) -> int:
    """The step named by `latest` (step_XXXXXXXX), 0 when absent or unreadable."""
    try:
        name = (ckpt_dir / "latest").read_text().strip()
        return int(name.rsplit("_", 1)[-1]) if name.startswith("step_") else 0
    except (OSError, ValueError):
        return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=1)
    args, overrides = ap.parse_known_args(argv)
    from megaframe.config import ConfigError, load_config
    from megaframe.errors import fail

    try:
        cfg = load_config(overrides, world_size=args.world_size)
    except ConfigError as e:
        return fail(e)
    ckpt = Path(cfg.checkpoint.dir).absolute()
    for key, value in (
        ("RUN_DIR", Path(cfg.run.dir).absolute()),
        ("CKPT_DIR", ckpt),
        ("MAX_STEPS", cfg.train.max_steps),
        ("LATEST_STEP", latest_step(ckpt)),
    ):
        print(f"{key}={shlex.quote(str(value))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
