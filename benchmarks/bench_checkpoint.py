"""Checkpoint cost on one process: save and load times, and the step-time overhead of saving every
few steps synchronously vs asynchronously (checkpoint.async), against not saving at all.

    python benchmarks/bench_checkpoint.py [layers=8] [hidden=512] [steps=12] [interval=3]

With `layouts`, instead: per-rank bytes and seconds of saves and loads across layouts on 4 gloo ranks
(the tiny test model, after one step so Adam moments exist): tp2·dp2 save, and a tp2·pp2 save loaded
as tp2·pp2, dp4 and pp4.

    PYTHONPATH=. python benchmarks/bench_checkpoint.py layouts
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from megaframe.checkpoint import sharded
from megaframe.checkpoint.async_save import AsyncSaver
from megaframe.config import load_config
from megaframe.config.derived import derive
from megaframe.data.dataset import BatchShape, microbatches
from megaframe.model.parallelize import build_for
from megaframe.parallel.mesh import single_process_mesh
from megaframe.training.startup import run_samples
from megaframe.training.step import optimizer_step


def run(cfg, mode: str, steps: int, interval: int, root: str) -> float:
    """Mean step time (s) including checkpoint work, for mode none | sync | async."""
    mesh = single_process_mesh()
    (model, opt), data = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh), run_samples(cfg)
    saver = AsyncSaver(mesh)
    t = cfg.train
    t0 = None
    for step in range(1, steps + 1):
        if step == 2:
            t0 = time.perf_counter()  # step 1 warms up
        batches = microbatches(
            data, step - 1, BatchShape(t.global_batch_size, t.micro_batch_size, t.seed), mesh
        )
        optimizer_step(model, opt, batches, mesh, cfg.optim, derive(cfg, 1), step)
        saver.poll(not saver.writing())  # one process: its own writer is all there is
        if step % interval == 0 and mode == "sync":
            sharded.save(root, step, model, opt, mesh, {"config": {}})
        elif step % interval == 0 and mode == "async":
            saver.save(root, step, model, opt, {"config": {}}, 0)
    saver.wait()
    return (time.perf_counter() - t0) / (steps - 1)


def layouts() -> None:
    from tests.distributed.ckpt_cases import load_and_report, train_and_save
    from tests.distributed.pool import RankPool

    pool = RankPool(4)
    over = ["model.num_layers=4", "train.micro_batch_size=1"]
    try:
        with tempfile.TemporaryDirectory() as root:
            for name, tp, pp in (("tp2·dp2", 2, 1), ("tp2·pp2", 2, 2)):
                got = pool.run(train_and_save, 4, over, f"{root}/{name}", 1, tp=tp, pp=pp)
                rows = [r["saves"][1] for r in got]
                total = sum(r["ckpt/write_bytes"] for r in rows)
                print(
                    f"save {name}: per rank write_bytes {[r['ckpt/write_bytes'] for r in rows]} "
                    f"(total/world {total / 4:.0f}), save_s {[round(r['ckpt/save_s'], 3) for r in rows]}"
                )
            for name, tp, pp in (("tp2·pp2", 2, 2), ("dp4", 1, 1), ("pp4", 1, 4)):
                got = pool.run(load_and_report, 4, over, f"{root}/tp2·pp2/step_00000001", tp=tp, pp=pp)
                print(
                    f"load tp2·pp2 -> {name}: per rank read_bytes "
                    f"{[r['read_bytes'] for r in got]}, of them data "
                    f"{[r['read_data_bytes'] for r in got]}, share {[r['needed_bytes'] for r in got]}, "
                    f"files opened {[r['files_opened'] for r in got]}, "
                    f"load_s {[round(r['load_s'], 3) for r in got]}"
                )
    finally:
        pool.close()


def main(argv: list[str]) -> None:
    if argv == ["layouts"]:
        return layouts()
    a = {
        "layers": "8",
        "hidden": "512",
        "steps": "12",
        "interval": "3",
        **dict(x.split("=", 1) for x in argv),
    }
    h = int(a["hidden"])
    cfg = load_config(
        [
            "data=synthetic",
            f"model.num_layers={a['layers']}",
            f"model.hidden_size={h}",
            "model.num_attention_heads=8",
            "model.num_query_groups=4",
            f"model.ffn_hidden_size={4 * h}",
            "model.seq_length=128",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
            "logging.wandb.mode=disabled",
        ],
        world_size=1,
        check_data=False,
    )
    torch.set_num_threads(torch.get_num_threads())
    steps, interval = int(a["steps"]), int(a["interval"])
    times = {}
    with tempfile.TemporaryDirectory() as root:
        for mode in ("none", "sync", "async"):
            times[mode] = run(cfg, mode, steps, interval, f"{root}/{mode}")
        path = sharded.latest(f"{root}/sync")
        mesh = single_process_mesh()
        model, opt = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
        t0 = time.perf_counter()
        sharded.load_into(path, model, opt)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # after the load, so the Adam moments are written too (as in the loop)
        sharded.save(f"{root}/one", 1, model, opt, mesh, {"config": {}})
        save_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(f"model {params / 1e6:.1f}M params, checkpoint {size / 2**20:.0f} MiB (weights + Adam moments)")
    print(f"save {save_s:.2f}s, load {load_s:.2f}s (planned byte ranges, each block checked as read)")
    print(
        f"step time, a checkpoint every {interval} steps: none {times['none']:.3f}s | "
        f"sync {times['sync']:.3f}s (+{100 * (times['sync'] / times['none'] - 1):.0f}%) | "
        f"async {times['async']:.3f}s (+{100 * (times['async'] / times['none'] - 1):.0f}%)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
