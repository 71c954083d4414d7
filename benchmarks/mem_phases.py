"""Memory per phase at real size on the CPU: measured against the planner, per layout.

    python benchmarks/mem_phases.py [--layers 8 --hidden 1024 --ffn 4096 --vocab 8192 --seq 256]
                                    [--layouts a,b]
                                 [--json OUT.json] [--replan OUT.json]

Each layout runs on gloo ranks spawned here (one thread each): start-up, one step, a blocking save and the
load of that save into a fresh model, each measured by the trainer's own meter
(megaframe/training/phase_run.py: the tensor bytes the rank allocated, from the CPU allocator's events). The
planner (memory/phases.py) sizes the same config (`--json` keeps the measured figures, `--replan` plans them
again without measuring). Prints phase x layout: measured (the largest rank), planned (that rank's
coordinate), ratio; then zero=3 dp4 against one process at zero=0 for start-up, save and load. The default
model (8 layers, hidden 1024, ffn 4096, vocab 8192, seq 256, GQA 16/4 heads) has 113M parameters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaframe.parallel.local import spawn_local  # noqa: E402

# name -> (ranks, tp, pp, overrides)
LAYOUTS = {
    "zero3-dp4": (4, 1, 1, ["optim.zero=3"]),
    "zero3-tp2-dp2": (4, 2, 1, ["optim.zero=3", "parallel.tp=2"]),
    "zero1-pp2-dp2": (4, 1, 2, ["optim.zero=1", "parallel.pp=2"]),
    "zero0-one": (1, 1, 1, ["optim.zero=0"]),
}
PHASES = ("startup", "step", "save", "load")


def model_overrides(a) -> list[str]:
    return [
        "data=synthetic",
        "train.device=cpu",
        f"model.num_layers={a.layers}",
        f"model.hidden_size={a.hidden}",
        f"model.ffn_hidden_size={a.ffn}",
        f"model.vocab_size={a.vocab}",
        f"model.seq_length={a.seq}",
        "model.num_attention_heads=16",
        "model.num_query_groups=4",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "train.max_steps=1",
        "logging.wandb.mode=disabled",
    ]


def _worker(rank: int, port: int, n: int, tp: int, pp: int, overrides: list[str], folder: str, out) -> None:
    from megaframe.config import load_config
    from megaframe.parallel.mesh import build_mesh
    from megaframe.training.phase_run import measure_phases

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=1800),
    )
    mesh = build_mesh(tp, pp, torch.device("cpu"))
    got = measure_phases(mesh, load_config(overrides, world_size=n, check_data=False), folder)
    rows = [None] * n
    dist.all_gather_object(rows, got)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def measure(name: str, base: list[str]) -> list[dict]:
    """Every rank's measured phases of one layout."""
    n, tp, pp, extra = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as folder:
        return spawn_local(_worker, n, n, tp, pp, base + extra, folder, timeout_s=3600)


def planned(name: str, base: list[str], rows: list[dict]) -> list[tuple[dict, dict]]:
    """[(measured, planned phases of its coordinate)] per rank of one layout."""
    from megaframe.config import load_config
    from megaframe.planning.memory.rank_plan import plan_layout

    n, _, _, extra = LAYOUTS[name]
    plan = {
        (r.pp_rank, r.tp_rank): r.phases
        for r in plan_layout(load_config(base + extra, world_size=n, check_data=False), n).ranks
    }
    return [(got, plan[(got["pp_rank"], got["tp_rank"])]) for got in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in (("layers", 8), ("hidden", 1024), ("ffn", 4096), ("vocab", 8192), ("seq", 256)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", help="write the measured figures here")
    ap.add_argument("--replan", help="plan the figures of an earlier --json again, measuring nothing")
    a = ap.parse_args()
    if a.replan:
        saved = json.loads(Path(a.replan).read_text())
        base, measured = saved["overrides"], saved["measured"]
    else:
        base, measured = model_overrides(a), {}
        for name in a.layouts.split(","):
            measured[name] = measure(name, base)
            print(f"{name}: measured", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps({"overrides": base, "measured": measured}))
    results = {name: planned(name, base, rows) for name, rows in measured.items()}
    mib = 2**20
    print(f"\n{'phase':8} " + " ".join(f"{name:>34}" for name in results))
    print(f"{'':8} " + " ".join(f"{'measured / planned MiB (ratio)':>34}" for _ in results))
    for ph in PHASES:
        cells = []
        for rows in results.values():
            got, want = max(rows, key=lambda r: r[0][ph] / r[1][ph])  # the rank furthest from its plan
            cells.append(f"{got[ph] / mib:9.1f} / {want[ph] / mib:9.1f} ({got[ph] / want[ph]:.3f})")
        print(f"{ph:8} " + " ".join(f"{c:>34}" for c in cells))
    if "zero3-dp4" in results and "zero0-one" in results:
        one = results["zero0-one"][0][0]
        print("\nzero=3 dp4 (largest rank) / one process at zero=0:")
        for ph in PHASES:
            mine = max(g[ph] for g, _ in results["zero3-dp4"])
            print(f"  {ph:8} {mine / mib:9.1f} / {one[ph] / mib:9.1f} MiB = {mine / one[ph]:.3f}")


if __name__ == "__main__":
    main()
