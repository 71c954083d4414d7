"""Check the planner's step-time model against measured runs on this machine (2 ranks, gloo, CPU).

    python benchmarks/validate_planner.py [--steps 8] [--out FILE.json]

1. Measures the "cpu" device (planning.devices.measure_cpu: one core's fp32 matmul rate, the time of a
   gloo hop against its size between two processes, planning.gloo_link).
2. Calibrates the compute efficiency right before each layout: two independent 1-process runs at once
   (so each gets the share of the cores a rank of a 2-rank layout gets on this shared machine, whose
   load drifts by the minute; no communication) at the layout's micro-batch size (CPU matmul rates
   depend on it): the fraction of the matmul rate a step reaches. The only fitted constant; the
   communication, bubble, recompute and splitting terms are predicted.
3. Runs six 2-rank layouts of a small model with torchrun (data=synthetic, short runs; --rounds times,
   in alternating order) and reads their step time from
   metrics.jsonl (tokens per step / tokens_per_s of each step after the first two): a run's best step,
   the median over rounds. On a shared machine `--priority -20` (root) gives the measured runs the
   cores: with autogroup scheduling a plain `nice` does not reach torchrun's workers.
4. Prints estimated vs measured step time per layout, the error, both rankings and Spearman's rho.
The machine's load average is printed before and after: other processes share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRIORITY: int | None = None
"""--priority: the autogroup nice of the measured runs (None: leave them at the default)."""
sys.path.insert(0, str(ROOT))

MODEL = [
    "data=synthetic",
    "model.num_layers=4",
    "model.hidden_size=192",
    "model.num_attention_heads=6",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=512",
    "model.seq_length=128",
    "model.vocab_size=2048",
    "train.global_batch_size=16",
    "logging.wandb.mode=disabled",
    "checkpoint.resume=none",
    "train.hang_timeout_s=0",
]
LAYOUTS = {  # name -> (search.Layout fields, extra overrides)
    "dp2": dict(tp=1, pp=1, vpp=1, dp=2, ep=1, zero=1, micro_batch=2, recompute="none"),
    "dp2-full-recompute": dict(tp=1, pp=1, vpp=1, dp=2, ep=1, zero=1, micro_batch=2, recompute="full"),
    "tp2-sp": dict(tp=2, pp=1, vpp=1, dp=1, ep=1, zero=1, micro_batch=2, recompute="none"),
    "pp2-mb2": dict(tp=1, pp=2, vpp=1, dp=1, ep=1, zero=1, micro_batch=2, recompute="none"),
    "pp2-vpp2-mb2": dict(tp=1, pp=2, vpp=2, dp=1, ep=1, zero=1, micro_batch=2, recompute="none"),
    "pp2-mb8": dict(tp=1, pp=2, vpp=1, dp=1, ep=1, zero=1, micro_batch=8, recompute="none"),
}


def _descendants(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    out = [int(k) for k in kids.read_text().split()] if kids.exists() else []
    return out + [d for k in out for d in _descendants(k)]


def hold_priority(proc: subprocess.Popen, nice: int) -> None:
    """Keep `proc`'s process tree at autogroup `nice` while it runs (Linux; needs root for < 0).

    With the kernel's autogroup scheduling a process's nice only ranks it inside its own session, and
    torchrun starts each worker in a new session: so the session's nice is set on every descendant as
    it appears. Measurements on a shared machine then see (nearly) whole cores."""

    def loop():
        done: set[int] = set()
        while proc.poll() is None:
            for pid in [proc.pid, *_descendants(proc.pid)]:
                if pid not in done:
                    try:
                        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
                        done.add(pid)
                    except OSError:  # gone already, or not permitted: measure at the default share
                        pass
            time.sleep(0.05)

    threading.Thread(target=loop, daemon=True).start()


def start(overrides: list[str], nproc: int, steps: int, run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("MEGAFRAME_RUN_NAME", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "train.py",
        *MODEL,
        *overrides,
        f"train.max_steps={steps}",
        "train.log_interval=1",
        f"run.dir={run_dir}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if PRIORITY is not None:
        hold_priority(proc, PRIORITY)
    return proc


def finish(proc: subprocess.Popen, run_dir: Path) -> float:
    """Best step time of a short run (the first two steps, with start-up effects, are left out): the
    fastest step is the one least disturbed by other processes on the shared cores."""
    _, err = proc.communicate(timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir.name}: exit {proc.returncode}\n{err[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    tokens = 16 * 128
    return min(tokens / r["tokens_per_s"] for r in rows)


def measured_step_s(overrides: list[str], nproc: int, steps: int, run_dir: Path) -> float:
    return finish(start(overrides, nproc, steps, run_dir), run_dir)


def calibrate(steps: int, tmp: Path, micro_batch: int) -> float:
    """Step time of one process while another identical one runs: the per-core rate two of our ranks
    get on this (shared) machine at this micro-batch size, with no communication at all."""
    procs = [
        (start([f"train.micro_batch_size={micro_batch}"], 1, steps, tmp / f"one{i}"), tmp / f"one{i}")
        for i in range(2)
    ]
    times = [finish(p, d) for p, d in procs]
    return sum(times) / len(times)


def spearman(a: list[float], b: list[float]) -> float:
    ra = {i: r for r, i in enumerate(sorted(range(len(a)), key=a.__getitem__))}
    rb = {i: r for r, i in enumerate(sorted(range(len(b)), key=b.__getitem__))}
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def main(argv: list[str]) -> int:
    from megaframe.config import load_config
    from megaframe.planning.candidate import Layout, layout_config
    from megaframe.planning.devices import measure_cpu
    from megaframe.planning.steptime.timing import step_time

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--rounds", type=int, default=2, help="runs per layout (alternating order); medians are used"
    )
    ap.add_argument("--out")
    ap.add_argument(
        "--priority",
        type=int,
        help="autogroup nice for the measured runs, e.g. -20 on a shared machine (root)",
    )
    ap.add_argument("--only", nargs="*", default=list(LAYOUTS), help="layouts to run (default: all six)")
    args = ap.parse_args(argv)
    global PRIORITY
    PRIORITY = args.priority
    print(f"load average before: {os.getloadavg()}", flush=True)
    dev = replace(measure_cpu(cores=2), efficiency=1.0)
    print(f"device: {dev.name}", flush=True)
    base = load_config(MODEL, world_size=1, check_data=False)
    tmp = Path(tempfile.mkdtemp(prefix="validate_planner_"))
    names = [n for n in LAYOUTS if n in args.only]
    measured: dict[str, list[float]] = {name: [] for name in names}
    calib: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):  # layouts in alternating order; each right after its own calibration
        for name in names if r % 2 == 0 else names[::-1]:
            lay = Layout(**LAYOUTS[name])
            calib[name].append(calibrate(args.steps, tmp / f"cal-{name}-{r}", lay.micro_batch))
            measured[name].append(measured_step_s(lay.overrides(), 2, args.steps, tmp / f"{name}-{r}"))
            print(
                f"  round {r + 1} {name:<20} calibration {calib[name][-1]:.3f} s/step, layout "
                f"{measured[name][-1]:.3f} s/step (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    rows = []
    for name in names:
        lay = Layout(**LAYOUTS[name])
        one = Layout(1, 1, 1, 1, 1, 1, lay.micro_batch, "none")
        t1 = statistics.median(calib[name])
        eff = step_time(layout_config(base, one), one, dev, 1)["compute"] / t1
        cfg = load_config(MODEL + lay.overrides(), world_size=2, check_data=False)
        parts = step_time(cfg, lay, replace(dev, efficiency=eff), 2)
        est, got = sum(parts.values()), statistics.median(measured[name])
        rows.append(
            {
                "layout": name,
                "estimated_s": est,
                "measured_s": got,
                "runs_s": measured[name],
                "calibration_s": calib[name],
                "efficiency": eff,
                "error": est / got - 1,
                "parts_ms": {k: round(v * 1e3, 1) for k, v in parts.items()},
            }
        )
        print(
            f"{name:<20} estimated {est:7.3f} s  measured "
            f"{got:7.3f} s  error {100 * (est / got - 1):+6.1f}%  "
            f"(efficiency {100 * eff:.0f}%; "
            f"{', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in parts.items() if v)})",
            flush=True,
        )
    est_rank = [r["layout"] for r in sorted(rows, key=lambda r: r["estimated_s"])]
    got_rank = [r["layout"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    rho = spearman([r["estimated_s"] for r in rows], [r["measured_s"] for r in rows])
    worst = max(abs(r["error"]) for r in rows)
    print(
        f"estimated ranking: {' < '.join(est_rank)}\nmeasured ranking:  {' < '.join(got_rank)}\n"
        f"Spearman rho {rho:.3f} | largest step-time error {100 * worst:.1f}%",
        flush=True,
    )
    print(f"load average after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": dev.name,
                    "rows": rows,
                    "rho": rho,
                    "estimated_rank": est_rank,
                    "measured_rank": got_rank,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
