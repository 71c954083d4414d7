"""Step time, memory and bytes of data parallelism on gloo (CPU), dp=2: plain all-reduce (zero=0); ZeRO-1
with the reduce-scatter overlapped with backward, and without (every bucket reduced after backward);
ZeRO-1 and ZeRO-2 with the parameter all-gather overlapped with the next forward
(optim.overlap_param_gather, the default) and without; ZeRO-3.

    python benchmarks/bench_zero.py [steps=2] [rounds=8] [bucket_mb=4] [threads=1]

Spawns 2 ranks (`threads` intra-op threads each), builds the three optimizers over three copies of a
~21M-parameter GPT (84 MB of fp32 grads: the dp traffic is a visible part of the step), and times
whole steps (zero_grad, forward/backward, optimizer step with its all-gather), modes interleaved in
rounds so drift hits all alike (a mode's overlapped gather is waited for, untimed, before the next mode
runs). Reports per mode the median step time split into forward/backward (with the overlapped gather:
including the waits for it) and the optimizer step (what waits for the reduce-scatter still in flight,
AdamW, the all-gather unless overlapped), the dp bytes per step, this rank's persistent grad and
optimizer-state bytes and the peak of ZeRO-2's transient bucket grads (mem/gathered_peak_bytes), and
the ratios. On a machine with few cores, gloo's communication threads compete with compute for
them, which caps what overlap can win.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megaframe.parallel.local import spawn_local

MODEL = [
    "data=synthetic",
    "model.num_layers=4",
    "model.hidden_size=512",
    "model.num_attention_heads=8",
    "model.num_query_groups=8",
    "model.ffn_hidden_size=1408",
    "model.seq_length=128",
    "model.vocab_size=8192",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "logging.wandb.mode=disabled",
    "train.max_steps=1000",
]
NO_GATHER_OVERLAP = ["optim.overlap_param_gather=false"]
# (name, overrides, reduce-scatter overlapped with backward; None: zero=0)
MODES = [
    ("zero1 overlap", ["optim.zero=1"], True),
    ("zero1 no overlap", ["optim.zero=1"] + NO_GATHER_OVERLAP, False),
    ("zero0 all-reduce", ["optim.zero=0"], None),
    ("zero1 no gather ovl", ["optim.zero=1"] + NO_GATHER_OVERLAP, True),
    ("zero2", ["optim.zero=2"], True),
    ("zero2 no gather ovl", ["optim.zero=2"] + NO_GATHER_OVERLAP, True),
    ("zero3", ["optim.zero=3"], True),
]


def _build(mesh, overrides: list[str], overlap):
    from megaframe.config import load_config
    from megaframe.model.parallelize import build_model_for
    from megaframe.optim.build import PlainOptimizer
    from megaframe.optim.zero import ZeroOptimizer
    from megaframe.optim.zero3 import Zero3Optimizer

    cfg = load_config(MODEL + overrides, world_size=mesh.world, check_data=False)
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    if cfg.optim.zero == 3:
        opt = Zero3Optimizer(model, cfg.optim, mesh)
    else:
        opt = (
            ZeroOptimizer(model, cfg.optim, mesh, overlap=overlap)
            if cfg.optim.zero
            else PlainOptimizer(model, cfg.optim, mesh)
        )
    return cfg, model, opt


def _timed_step(model, opt, batches, mesh, cfg, step: int) -> tuple[float, float]:
    """train_step split in two: (zero_grad + forward/backward, optimizer step) wall seconds."""
    from megaframe.pipeline.executor import run_schedule
    from megaframe.pipeline.grouping import build_schedule

    t0 = time.perf_counter()
    opt.zero_grad()
    run_schedule(
        build_schedule(model.schedule, mesh.pp.size, cfg.parallel.vpp, len(batches), mesh.pp.rank),
        model,
        batches,
        mesh,
        opt,
        cfg.train.global_batch_size * cfg.model.seq_length,
    )
    t1 = time.perf_counter()
    opt.step(cfg.optim.lr)
    return t1 - t0, time.perf_counter() - t1


def _worker(rank: int, port: int, steps: int, rounds: int, bucket_mb: float, threads: int, out) -> None:
    from megaframe.data.dataset import BatchShape, microbatches
    from megaframe.parallel.mesh import build_mesh
    from megaframe.training.startup import run_samples

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )
    mesh = build_mesh(1, 1, torch.device("cpu"))
    runs = {
        name: _build(mesh, over + [f"optim.bucket_size_mb={bucket_mb}"], overlap)
        for name, over, overlap in MODES
    }
    cfg = next(iter(runs.values()))[0]
    data, t = run_samples(cfg), cfg.train
    times = {name: [] for name in runs}
    sent = {}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        for name, (c, model, opt) in runs.items():
            for _ in range(steps):
                step += 1
                batches = microbatches(
                    data, step, BatchShape(t.global_batch_size, t.micro_batch_size, t.seed), mesh
                )
                dist.barrier()
                mesh.stats.pop()
                phases = _timed_step(model, opt, batches, mesh, c, step)
                if r:
                    times[name].append(phases)
                sent[name] = mesh.stats.pop().get("dp", 0)
            opt.sync_params()  # this mode's overlapped gather must not run into the next mode's step
    n_params = sum(p.numel() for p in runs[MODES[0][0]][1].parameters())
    from megaframe.training.metrics import memory_figures

    mem = {name: memory_figures(model, opt, mesh.device) for name, (_, model, opt) in runs.items()}
    if rank == 0:
        out.put((times, sent, n_params, len(runs[MODES[0][0]][2].buffers[0].buckets), mem))
    dist.barrier()
    dist.destroy_process_group()


def main(steps: int = 2, rounds: int = 8, bucket_mb: float = 4.0, threads: int = 1) -> None:
    times, sent, n_params, buckets, mem = spawn_local(
        _worker, 2, steps, rounds, bucket_mb, threads, timeout_s=3600
    )
    print(
        f"dp=2 on gloo, {os.cpu_count()} cores, {threads} thread(s)/rank | {n_params / 1e6:.1f}M params "
        f"({4 * n_params / 2**20:.0f} MiB fp32 grads), {buckets} buckets of {bucket_mb} MiB | "
        f"{rounds} rounds x {steps} steps per mode"
    )
    med = {}
    for name, ts in times.items():
        total = [a + b for a, b in ts]
        med[name] = statistics.median(total)
        fb, st = statistics.median(a for a, _ in ts), statistics.median(b for _, b in ts)
        print(
            f"  {name:18s} step median {med[name] * 1e3:7.1f} ms (min {min(total) * 1e3:7.1f}, max "
            f"{max(total) * 1e3:7.1f}) = fwd/bwd {fb * 1e3:7.1f} + optimizer step {st * 1e3:6.1f} | "
            f"dp bytes/step {sent[name] / 2**20:5.1f} MiB | params "
            f"{mem[name]['mem/params_bytes'] / 2**20:5.1f} MiB, "
            f"grads {mem[name]['mem/grads_bytes'] / 2**20:5.1f} "
            f"MiB, optim {mem[name]['mem/optim_bytes'] / 2**20:5.1f} "
            "MiB, transient (grads, zero=3 params) peak "
            f"{mem[name].get('mem/gathered_peak_bytes', 0) / 2**20:4.1f} MiB"
        )
    print(f"ratio overlap / no overlap: {med['zero1 overlap'] / med['zero1 no overlap']:.3f}")
    print(f"ratio overlap / zero0 all-reduce: {med['zero1 overlap'] / med['zero0 all-reduce']:.3f}")
    print(f"ratio no overlap / zero0 all-reduce: {med['zero1 no overlap'] / med['zero0 all-reduce']:.3f}")
    for z in ("zero1", "zero2"):
        on = med["zero1 overlap" if z == "zero1" else z]
        print(f"ratio {z} gather overlapped / not: {on / med[z + ' no gather ovl']:.3f}")


if __name__ == "__main__":
    kw = dict(a.split("=", 1) for a in sys.argv[1:])
    main(
        int(kw.get("steps", 2)),
        int(kw.get("rounds", 8)),
        float(kw.get("bucket_mb", 4.0)),
        int(kw.get("threads", 1)),
    )
