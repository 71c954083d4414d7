"""Training curves from metrics.jsonl, without a wandb account: several runs on one figure.

    python -m megaframe.plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--x tokens|step]
    python -m megaframe.plot --trace RUN_DIR/profile [--step N] [--out FILE.png]   one profiled step per rank
    python -m megaframe.plot --goodput RUN_DIR [--out FILE.png]                    the wall time by bucket

Panels: loss (solid) and val_loss (dashed, where logged) against tokens seen (or steps), learning
rate, grad norm, tokens/s and MFU. Each run is one colour, labelled by its folder name. A step logged
twice (after a restart) counts once, the later line winning. Writes FILE.png (default loss.png) with
matplotlib's Agg backend (no display needed). A folder without metrics.jsonl exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megaframe import plot_views
from megaframe.errors import fail, write_refused

PANELS = [
    ("loss", "loss (val dashed)"),
    ("lr", "learning rate"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
    ("mfu", "MFU (%)"),
]
SCALE = {"mfu": 100.0}
"""metrics.jsonl holds MFU as a fraction; the panel shows percent."""
GRID = [(0, slice(0, 2)), (0, 2), (1, 0), (1, 1), (1, 2)]
"""Where each panel sits on a 2 x 3 grid: the loss twice as wide (before: one 1600 x 272 px strip)."""


def read_run(run_dir: str | Path) -> list[dict]:
    """Rows of metrics.jsonl by step (the later line wins); ValueError when there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run folder)")
    rows = {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # K7: the message named no file
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a metrics row ({e})") from e
    if not rows:
        raise ValueError(f"{path} is empty")
    return [rows[s] for s in sorted(rows)]


def _config_sizes(path: Path) -> tuple[int, int] | None:
    """(global batch, seq_length) of a run config file, None when it has none."""
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(path)
        return int(cfg.train.global_batch_size), int(cfg.model.seq_length)
    except (OSError, AttributeError, ValueError, TypeError):
        return None


def tokens_per_step(run_dir: Path, rows: list[dict]) -> float | None:
    """Global batch x sequence length from the run's config.yaml (None when it has none)."""
    sizes = _config_sizes(run_dir / "config.yaml")
    return float(sizes[0] * sizes[1]) if sizes else None


def seq_lengths(run_dir: Path) -> dict[int, int]:
    """{start step: seq_length} of each start: config.yaml (step 0) and each resume's config.resume-N.yaml."""
    out = {}
    for path in [run_dir / "config.yaml", *run_dir.glob("config.resume-*.yaml")]:
        start = 0 if path.name == "config.yaml" else path.stem.removeprefix("config.resume-")
        sizes = _config_sizes(path)
        if sizes and str(start).isdigit():
            out[int(start)] = sizes[1]
    return out


def token_positions(run_dir: Path, rows: list[dict]) -> list[float] | None:
    """Tokens consumed at each row: its consumed_tokens, else its consumed_samples x the seq_length of the
    start that logged it, else step x the first config's tokens per step (rows written before either was
    logged); None when no row can be placed. The consumed counts are exact after a resume that changed the
    batch size or (RoPE) the sequence length, where step x the first config's tokens bent the axis."""
    seqs, tps, out = seq_lengths(run_dir), tokens_per_step(run_dir, rows), []
    for r in rows:
        seq = seqs[max((s for s in seqs if s < r["step"]), default=0)] if seqs else None
        if r.get("consumed_tokens") is not None:
            out.append(float(r["consumed_tokens"]))
        elif r.get("consumed_samples") is not None and seq:
            out.append(float(r["consumed_samples"] * seq))
        elif tps:
            out.append(r["step"] * tps)
        else:
            return None
    return out


def plot(runs: list[str], out: str, x_axis: str = "tokens") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot's import: no display on a compute node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    fig = plt.figure(figsize=(13, 7.5))
    grid = fig.add_gridspec(2, 3)
    axes = [fig.add_subplot(grid[r, c]) for r, c in GRID]
    for i, run in enumerate(runs):
        rows, color = read_run(run), f"C{i % 10}"
        tokens = token_positions(Path(run), rows) if x_axis == "tokens" else None
        xs = tokens or [r["step"] for r in rows]
        for ax, (key, _) in zip(axes, PANELS):
            pts = [(x, r[key] * SCALE.get(key, 1.0)) for x, r in zip(xs, rows) if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, label=Path(run).name)
            if key == "loss":
                val = [(x, r["val_loss"]) for x, r in zip(xs, rows) if r.get("val_loss") is not None]
                if val:
                    ax.plot(*zip(*val), color=color, linestyle="--", marker=".")
    xlabel = "tokens" if x_axis == "tokens" else "step"
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if key in ("loss", "grad_norm"):
            ax.set_yscale("log")  # both span orders of magnitude over a run
            # label the 2..9 ticks too while the axis spans under 3 decades: a loss of 4 -> 3 had 2 labels
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(3, 1)))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return Path(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaframe.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run folders holding metrics.jsonl")
    ap.add_argument("--out", default="loss.png")
    ap.add_argument("--x", choices=["tokens", "step"], default="tokens", help="x axis")
    ap.add_argument("--trace", help="a train.profile_steps trace, or the profile/ folder: one step per rank")
    ap.add_argument("--step", type=int, help="with --trace: the profiled step to draw (default: the first)")
    ap.add_argument("--goodput", metavar="RUN_DIR", help="the run's wall time by goodput bucket")
    args = ap.parse_args(argv)
    if bool(args.runs) + bool(args.trace) + bool(args.goodput) != 1:
        return fail("give run folders, or --trace PATH, or --goodput RUN_DIR (one of them)")
    out = Path(args.out)
    # before reading any run: a missing folder was a FileNotFoundError traceback from savefig
    if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        return fail(f"--out {args.out}: not a file in a writable folder")
    try:
        if args.trace:
            path = plot_views.draw_trace(args.trace, args.out, args.step)
        elif args.goodput:
            path = plot_views.draw_goodput(args.goodput, args.out)
        else:
            path = plot(args.runs, args.out, args.x)
    except ValueError as e:
        return fail(e)
    except OSError as e:  # a full disk or the file-size limit at savefig
        if not write_refused(e):
            raise
        return fail(f"--out {args.out}: cannot write the plot ({e})", code=1)
    what = f"{len(args.runs)} run(s)" if args.runs else ("trace" if args.trace else "goodput")
    print(f"plot: {what} -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
