"""Context parallelism on this machine (gloo, ranks as processes): tokens/s and peak activation memory
per rank of one forward + backward at seq 2048 and 8192 for cp 1/2/4, for cp_comm=allgather and ring,
the ring with its K/V exchange not overlapped with the block attention (ring_attention's internal
`overlap=False`: each exchange issued after the block's attention and waited for at once: the same bytes
and results, the transfer on the critical path), and the ring on its fp32 math blocks instead of the fused
flash kernels (ring_attention's `fused=False`, the path before ring_fused.py). Ratios are against cp1
measured in the same run; a line per cp also gives the ring's math / fused step-time ratio.

    python benchmarks/bench_cp.py [seqs=2048,8192] [cps=1,2,4] [steps=3] [layers=2] [threads=1]

A small GPT (D=64, 4 heads, 2 kv groups, FFN 256, vocab 256), one sequence per step: tokens/s is
seq / (fastest step time: on a shared machine the least disturbed one), the whole cp group working on one
sequence, every rank starting each step together (a barrier) and the slowest rank's time counted. Peak: the
CPU allocator's own events during one forward + backward (memory.activations.allocator_peak), max over the
cp ranks, next to the planner's activation figure for the same layout. With more ranks than cores, cp ranks
share cores: tokens/s then shows the communication and split-attention overhead, not a speed-up.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from megaframe.parallel.local import spawn_local

MODEL = [
    "data=synthetic",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=256",
    "model.vocab_size=256",
    "model.dropout=0.0",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
    "logging.wandb.mode=disabled",
]


def overrides(seq: int, cp: int, kind: str, layers: int) -> list[str]:
    return MODEL + [
        f"model.seq_length={seq}",
        f"model.num_layers={layers}",
        f"parallel.cp={cp}",
        f"parallel.cp_comm={kind}",
    ]


def _rank(
    rank: int, port: int, world: int, over: list[str], overlap: bool, fused: bool, steps: int, threads: int, q
) -> None:
    from megaframe.config import load_config
    from megaframe.model.parallelize import build_model_for
    from megaframe.parallel.context import cp_causal_bias, cp_keep
    from megaframe.parallel.mesh import build_mesh
    from megaframe.planning.memory.activations import allocator_peak

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = build_mesh(1, 1, torch.device("cpu"), cp=world, timeout=datetime.timedelta(seconds=600))
    cfg = load_config(over, world_size=world, check_data=False)
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    for block in model.layers.values():
        block.attn.ring_overlap = overlap
        block.attn.ring_fused = fused
    ids_BS = torch.randint(
        0, cfg.model.vocab_size, (1, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(0)
    )
    x_BS, y_BS = cp_keep(ids_BS[:, :-1], mesh.cp.rank, world), cp_keep(ids_BS[:, 1:], mesh.cp.rank, world)

    def step():
        model(x_BS, y_BS).sum().backward()

    step()  # warm-up: grads exist from here on, lazy state built
    times = []
    for _ in range(steps):
        dist.barrier()  # every rank starts the step together: the slowest rank's time is the group's
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    # the cp bias (built only with attention dropout) is rebuilt inside the measurement, as in a first step
    cp_causal_bias.cache_clear()
    peak = allocator_peak(step)
    t = torch.tensor([min(times), float(peak)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        q.put((t[0].item(), int(t[1].item())))
    dist.destroy_process_group()


def run(
    seq: int, cp: int, kind: str, overlap: bool, steps: int, layers: int, threads: int, fused: bool = True
) -> tuple[float, int]:
    return spawn_local(_rank, cp, cp, overrides(seq, cp, kind, layers), overlap, fused, steps, threads)


def planned(seq: int, cp: int, kind: str, layers: int) -> int:
    from megaframe.config import load_config
    from megaframe.planning.memory.rank_plan import plan_layout

    cfg = load_config(overrides(seq, cp, kind, layers), world_size=cp, check_data=False)
    return plan_layout(cfg, cp).ranks[0].activation_bytes


def main(argv: list[str]) -> int:
    opts = dict(a.split("=", 1) for a in argv)
    seqs = [int(x) for x in opts.get("seqs", "2048,8192").split(",")]
    cps = [int(x) for x in opts.get("cps", "1,2,4").split(",")]
    steps, layers, threads = (
        int(opts.get("steps", 3)),
        int(opts.get("layers", 2)),
        int(opts.get("threads", 1)),
    )
    print(
        f"bench_cp: {layers} layers D=64, one sequence per step, "
        f"fastest of {steps} timed steps, {threads} thread(s) "
        f"per rank, {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    mib = 2**20
    print(
        f"{'seq':>5} {'cp':>3} {'variant':<18} {'step s':>8} {'tok/s':>8} {'x cp1':>6} {'peak MiB':>9} "
        f"{'x cp1':>6} {'planned MiB':>11}",
        flush=True,
    )
    for seq in seqs:
        base = None
        for cp in cps:
            variants = (
                [("allgather", True, True)]
                if cp == 1
                else [
                    ("allgather", True, True),
                    ("ring", True, True),
                    ("ring", True, False),
                    ("ring", False, True),
                ]
            )
            times = {}
            for kind, overlap, fused in variants:
                t, peak = run(seq, cp, kind, overlap, steps, layers, threads, fused)
                base = base or (t, peak)
                name = kind if cp == 1 or overlap else "ring, no overlap"
                name = name if fused else "ring, fp32 math"
                name = "(no cp)" if cp == 1 else name
                times[name] = t
                print(
                    f"{seq:>5} {cp:>3} {name:<18} {t:>8.3f} {seq / t:>8.0f} {base[0] / t:>6.2f} "
                    f"{peak / mib:>9.1f} {peak / base[1]:>6.2f} "
                    f"{planned(seq, cp, kind, layers) / mib:>11.1f}",
                    flush=True,
                )
            if "ring, fp32 math" in times:  # the same run, the same machine state: the fused kernels' gain
                print(
                    f"{seq:>5} {cp:>3} ring step time: fp32 math / fused = "
                    f"{times['ring, fp32 math'] / times['ring']:.2f}, ring / allgather = "
                    f"{times['ring'] / times['allgather']:.2f}",
                    flush=True,
                )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
