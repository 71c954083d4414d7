"""Hydra multirun sweeps under Slurm: one pretrain.sbatch job per point of the cartesian product.

    python scripts/slurm/sweep.py [--name NAME] [--script PATH] [--dry-run] OVERRIDE... [-- SBATCH_FLAG...]
    python scripts/slurm/sweep.py optim.lr=1e-3,3e-3 model=gpt_tiny,gpt2_tiny train.max_steps=500 \\
        -- --nodes=1 --ntasks-per-node=4 --time=01:00:00

Overrides use Hydra's sweep syntax (`a=1,2`, `a=range(1,4)`, `a=choice(x,y)`; plain `a=1` is kept in
every point) and are parsed by Hydra's own override parser, so a point is exactly what `train.py
--multirun` would run. Each point is submitted as `sbatch --job-name=NAME-i [SBATCH_FLAG...]
SCRIPT <point overrides>` (SCRIPT: scripts/slurm/pretrain.sbatch, or --script PATH, e.g. a site's copy);
pretrain.sbatch names the run `NAME-i-<job id>`, so every point has its own run dir
(outputs/NAME-i-<job id>), checkpoints and wandb run, and each job is requeued and resumed on its own.
A run.dir or checkpoint.dir given for the whole sweep is each point's parent folder, as Hydra's multirun
does with its sweep dir: `run.dir=runs/lr` gives point i `run.dir=runs/lr/i`. Points that would still
share a run folder (one run.name for all) are refused, nothing submitted: a later point would resume the
first one's checkpoint and train nothing. Prints one line per point: index, job id, run name, overrides.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # megaframe, for the points' config checks

from megaframe.errors import fail  # noqa: E402  (after the path insert)

SBATCH_SCRIPT = Path(
    os.environ.get("MEGAFRAME_SBATCH_SCRIPT") or Path(__file__).resolve().parent / "pretrain.sbatch"
)
"""The default job script; --script (or MEGAFRAME_SBATCH_SCRIPT) names another, e.g. a site's copy."""

FOLDER_KEYS = ("run.dir", "checkpoint.dir")
"""The folders a point writes; a value every point shares becomes each point's parent folder."""


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
            raise SweepError(
                f"{o.input_line}: interval sweeps need an optimizer sweeper; use a list or range()"
            )
    return [list(point) for point in itertools.product(*choices)]


ANY_WORLD = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
"""World sizes tried when the sbatch flags do not give
one: a point passes if a job of some size could run it."""


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of an sbatch flag given as `--name=V` or `--name V` (the last one wins), else None."""
    value = None
    for i, f in enumerate(flags):
        if f.startswith(f"--{name}="):
            value = f.split("=", 1)[1]
        elif f == f"--{name}" and i + 1 < len(flags):
            value = flags[i + 1]
    return value


def script_default(name: str, script: Path | None = None) -> str | None:
    """The job script's own `#SBATCH --name=V` line (what a job gets when the command line does not say)."""
    try:
        lines = Path(script or SBATCH_SCRIPT).read_text().splitlines()
    except OSError:
        return None
    return flag_value([ln.split(None, 1)[1] for ln in lines if ln.startswith("#SBATCH ")], name)


def world_size(flags: list[str], script: Path | None = None) -> int | None:
    """Ranks of each job: --ntasks, else --nodes x --ntasks-per-node (the job script's #SBATCH line filling
    a flag not given, nodes 1 by default); None when neither says (then every point is checked against
    some world size that fits it)."""
    try:
        if flag_value(flags, "ntasks"):
            return int(flag_value(flags, "ntasks"))
        per_node = flag_value(flags, "ntasks-per-node") or script_default("ntasks-per-node", script)
        nodes = flag_value(flags, "nodes") or script_default("nodes", script) or "1"
        return int(nodes) * int(per_node) if per_node else None
    except ValueError:  # a range or an expression sbatch resolves itself: no world check then
        return None


def check_point(point: list[str], world: int | None, run_name: str = ""):
    """Compose and validate the point as train.py will (keys, types, choices, the config checks) for `world`
    ranks, or, without one, for the first size in ANY_WORLD that fits; `run_name` stands for the name the
    job gives it (MEGAFRAME_RUN_NAME). Returns the config; raises ConfigError."""
    from megaframe.config import ConfigError, load_config

    saved = os.environ.get("MEGAFRAME_RUN_NAME")
    os.environ["MEGAFRAME_RUN_NAME"] = run_name or "sweep-point"
    try:
        if world is not None:
            return load_config(point, world_size=world)
        errors = []
        for w in ANY_WORLD:
            try:
                return load_config(point, world_size=w)
            except ConfigError as e:
                errors.append(str(e))
    finally:
        os.environ.pop("MEGAFRAME_RUN_NAME")
        if saved is not None:
            os.environ["MEGAFRAME_RUN_NAME"] = saved
    # a problem of the point itself rather than of one size's arithmetic, when there is one
    raise ConfigError(next((e for e in errors if "world size" not in e), errors[0]))


def own_folders(points: list[list[str]]) -> list[list[str]]:
    """Each point its own run folder: a run.dir / checkpoint.dir override whose value the points share
    (given once, or swept with fewer values than points) gets the point's index as a subfolder, as Hydra's
    multirun puts job i in <sweep dir>/i. Values distinct per point, and interpolations (resolved per
    point), are kept."""
    points = [list(p) for p in points]
    for key in FOLDER_KEYS:
        at = [[j for j, o in enumerate(p) if o.lstrip("+").startswith(f"{key}=")] for p in points]
        values = [p[js[-1]].split("=", 1)[1] if js else None for p, js in zip(points, at)]
        if len(points) < 2 or len(set(values)) == len(values):
            continue
        for i, (p, js) in enumerate(zip(points, at)):
            if js and "${" not in values[i]:
                head = p[js[-1]].split("=", 1)[0]
                p[js[-1]] = f"{head}={values[i].rstrip('/') or '/'}/{i}"
    return points


def check_points(points: list[list[str]], world: int | None, name: str = "sweep") -> str | None:
    """The first invalid point, or two points that would write one run folder (a later one would resume
    the first one's checkpoint and train nothing), as one line naming it and the cause, else None; before
    anything is submitted."""
    from megaframe.config import ConfigError
    from megaframe.errors import one_line

    seen: dict[tuple[str, str], int] = {}
    for i, point in enumerate(points):
        try:
            cfg = check_point(point, world, f"{name}-{i}-JOBID")
        except ConfigError as e:
            ranks = f" on {world} ranks" if world else ""
            return f"point {i} ({' '.join(point)}){ranks}: {one_line(e)}; nothing submitted"
        for key, folder in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
            first = seen.setdefault((key, os.path.abspath(folder)), i)
            if first != i:
                return (
                    f"point {i} ({' '.join(point)}) writes {key}={folder} as point {first} does: every point "
                    "needs its own run folder (leave run.name and run.dir out: point i gets "
                    "outputs/NAME-i-<job id>; or give run.dir=PATH: point i gets PATH/i); nothing submitted"
                )
    return None


def satisfiable(flags: list[str], point: list[str], env: dict, script: Path) -> str | None:
    """One line when no partition can run the request (a GPU flag on a CPU cluster, more CPUs per task than a
    node has, a partition's limits), else None: `sbatch --test-only` asks the controller and submits nothing,
    so the sweep fails here instead of leaving jobs pending forever. The points share the flags: one asks."""
    res = subprocess.run(
        ["sbatch", "--test-only", *flags, str(script), *point], capture_output=True, text=True, env=env
    )
    if res.returncode == 0:
        return None
    why = " ".join((res.stderr or res.stdout).split()) or f"exit {res.returncode}"
    return (
        f"no partition can run these sbatch flags ({shlex.join(flags) or 'the script defaults'}): {why}; "
        "nothing submitted"
    )


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        argv, sbatch_flags = argv[:cut], argv[cut + 1 :]
    else:
        sbatch_flags = []
    ap = argparse.ArgumentParser(
        prog="sweep.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--name",
        default=time.strftime("sweep-%Y%m%d-%H%M%S"),
        help="job name prefix; point i runs as job NAME-i (default: sweep-<date>-<time>)",
    )
    ap.add_argument(
        "--script",
        type=Path,
        default=SBATCH_SCRIPT,
        help="the job script each point is submitted with (default: scripts/slurm/pretrain.sbatch)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch commands, submit nothing")
    ap.add_argument("overrides", nargs="*")
    # options anywhere among the overrides (`sweep.py optim.lr=1e-3,3e-3 --script site.sbatch`)
    args = ap.parse_intermixed_args(argv)
    if not args.script.is_file():
        return fail(f"--script {args.script}: no such file; nothing submitted")
    try:
        points = own_folders(expand(args.overrides))
    except SweepError as e:
        return fail(e)
    # a bad point fails here, not in the queue
    problem = check_points(points, world_size(sbatch_flags, args.script), args.name)
    if problem:
        return fail(problem)
    if not args.dry_run and shutil.which("sbatch") is None:
        print("sweep.py: error: sbatch not found on PATH", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "MEGAFRAME_RUN_NAME"}  # each job names its own run
    if not args.dry_run:
        problem = satisfiable(sbatch_flags, points[0], env, args.script)
        if problem:
            return fail(problem)
    for i, point in enumerate(points):
        cmd = [
            "sbatch",
            "--parsable",
            f"--job-name={args.name}-{i}",
            *sbatch_flags,
            str(args.script),
            *point,
        ]
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
