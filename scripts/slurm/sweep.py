"""Hydra multirun sweeps under Slurm: one pretrain.sbatch job per point of the cartesian product.

    python scripts/slurm/sweep.py [--name NAME] [--dry-run] OVERRIDE... [-- SBATCH_FLAG...]
    python scripts/slurm/sweep.py optim.lr=1e-3,3e-3 model=gpt_tiny,gpt2_tiny train.max_steps=500 \\
        -- --nodes=1 --ntasks-per-node=4 --time=01:00:00

Overrides use Hydra's sweep syntax (`a=1,2`, `a=range(1,4)`, `a=choice(x,y)`; plain `a=1` is kept in
every point) and are parsed by Hydra's own override parser, so a point is exactly what `train.py
--multirun` would run. Each point is submitted as `sbatch --job-name=NAME-i [SBATCH_FLAG...]
scripts/slurm/pretrain.sbatch <point overrides>`; pretrain.sbatch names the run `NAME-i-<job id>`,
so every point has its own run dir (outputs/NAME-i-<job id>), checkpoints and wandb run, and each
job is requeued and resumed on its own. Prints one line per point: index, job id, overrides.
Run it with the megaframe venv active: the jobs run the `python` on PATH at submission.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

SBATCH_SCRIPT = Path(os.environ.get("MEGAFRAME_SBATCH_SCRIPT") or Path(__file__).resolve().parent / "pretrain.sbatch")
"""The job script; MEGAFRAME_SBATCH_SCRIPT names another (a site's copy, or the tests' CPU-only one)."""


class SweepError(ValueError):
    pass


def expand(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of the sweep overrides, in Hydra's BasicSweeper order (last key fastest)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise SweepError(" ".join(str(e).split())) from e
    choices = []
    for o in parsed:
        if not o.is_sweep_override():
            choices.append([o.input_line])
        elif o.is_discrete_sweep():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            raise SweepError(f"{o.input_line}: interval sweeps need an optimizer sweeper; use a list or range()")
    return [list(point) for point in itertools.product(*choices)]


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        argv, sbatch_flags = argv[:cut], argv[cut + 1:]
    else:
        sbatch_flags = []
    ap = argparse.ArgumentParser(prog="sweep.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--name", default=time.strftime("sweep-%Y%m%d-%H%M%S"),
                    help="job name prefix; point i runs as job NAME-i (default: sweep-<date>-<time>)")
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch commands, submit nothing")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        points = expand(args.overrides)
    except SweepError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    if not args.dry_run and shutil.which("sbatch") is None:
        print("sweep.py: error: sbatch not found on PATH", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "MEGAFRAME_RUN_NAME"}  # each job names its own run
    for i, point in enumerate(points):
        cmd = ["sbatch", "--parsable", f"--job-name={args.name}-{i}", *sbatch_flags, str(SBATCH_SCRIPT), *point]
        if args.dry_run:
            print(shlex.join(cmd), flush=True)
            continue
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            print(f"sweep.py: error: sbatch failed for point {i}: {res.stderr.strip()}", file=sys.stderr)
            return 1
        job = res.stdout.strip().split(";")[0]
        print(f"{i}\t{job}\t{args.name}-{i}-{job}\t{' '.join(point)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
