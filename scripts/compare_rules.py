"""Muon beside AdamW on the same data at equal tokens: one run per update rule (optim.name), then their loss
curves on one figure drawn by `python -m megaframe.plot`.

    python scripts/compare_rules.py --steps 300 --out docs/rules_loss.png [KEY=VALUE ...]

Each rule trains `--steps` steps of the same model, batch, seed and schedule into RUN_ROOT/<rule>; the
overrides after the options go to both runs (e.g. a smaller model). Muon takes its own lr on the hidden
matrices (--muon-lr) and AdamW's lr on the rest (optim.muon.adamw_lr). Prints each run's final loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="rules_loss.png")
    ap.add_argument("--run-root", default="outputs/rules")
    ap.add_argument("--muon-lr", type=float, default=0.02, help="optim.lr of Muon's hidden matrices")
    ap.add_argument("overrides", nargs="*", help="config overrides both runs take")
    args = ap.parse_args(argv)
    common = [f"train.max_steps={args.steps}", "train.log_interval=1", *args.overrides]
    dirs = []
    for rule in ("adamw", "muon"):
        # absolute: the runs, the lr read back and the plot all use one folder, wherever this is run from
        run_dir = Path(args.run_root).resolve() / rule
        cmd = [sys.executable, str(ROOT / "train.py"), f"optim.name={rule}", f"run.dir={run_dir}", *common]
        # Muon: its own lr on the hidden matrices, the AdamW run's peak lr on the embedding, head, norms
        if rule == "muon":
            adamw_lr = float(OmegaConf.load(Path(dirs[0]) / "config.yaml").optim.lr)
            cmd += [f"optim.lr={args.muon_lr}", f"optim.muon.adamw_lr={adamw_lr}"]
        subprocess.run(cmd, check=True)
        dirs.append(str(run_dir))
    for rule, d in zip(("adamw", "muon"), dirs):
        last = (Path(d) / "metrics.jsonl").read_text().splitlines()[-1]
        print(f"{rule}: final loss {json.loads(last)['loss']:.4f}")
    plot = [sys.executable, "-m", "megaframe.plot", *dirs, "--out", args.out, "--x", "tokens"]
    return subprocess.run(plot).returncode


if __name__ == "__main__":
    sys.exit(main())
