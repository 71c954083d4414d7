"""Measured step time and pipeline bubble on gloo (CPU) per schedule, against the simulator's.

    python benchmarks/bench_pipeline.py [pp=2] [microbatches=8] [steps=3] [p2p=native|nccl]
                                     [kinds=1f1b,interleaved,zb_h1,zbv]

Spawns pp ranks (1 thread each), trains a small GPT for a few steps under each schedule (one run, one
process group) and reports per schedule: the step time, the measured bubble (1 - compute time / step
time, from the executor's timeline, averaged over ranks and the timed steps), the measured F, B, W
times of a stage (a chunk's times x vpp; a kind that does not split the backward has its whole backward
as B) and the simulator's bubble for those costs under rendezvous sends (pipeline.simulate.Costs), with
the ratio measured / simulated; and the formula (pp-1)/(vpp*m+pp-1). The zero-bubble kinds need the
executor's split backward (W actions). `p2p=nccl` runs the transfers under NCCL's rules emulated on gloo
(MEGAFRAME_P2P_SEMANTICS, parallel/p2p_semantics.py). On a machine with fewer cores than ranks the ranks
share cores and the measurement mixes bubble with contention: use pp <= cores.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from megaframe.parallel.local import spawn_local
from megaframe.parallel.p2p_semantics import ENV_VAR, P2PSemantics
from megaframe.pipeline.schedule import admitted_vpps
from megaframe.pipeline.simulate import Costs, SendModel, simulate

MODEL = [
    "data=synthetic",
    "model.num_layers=8",
    "model.hidden_size=256",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=704",
    "model.seq_length=128",
    "model.vocab_size=1024",
    "train.micro_batch_size=2",
    "logging.wandb.mode=disabled",
]


def _worker(rank: int, port: int, pp: int, m: int, steps: int, schedules: list, out) -> None:
    from megaframe.config import load_config
    from megaframe.data.dataset import BatchShape, microbatches
    from megaframe.model.parallelize import build_for
    from megaframe.parallel.mesh import build_mesh
    from megaframe.pipeline import p2p
    from megaframe.pipeline.executor import run_schedule
    from megaframe.pipeline.grouping import build_schedule
    from megaframe.training.startup import run_samples

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=pp,
        timeout=datetime.timedelta(seconds=120),
    )
    mesh = build_mesh(1, pp, torch.device("cpu"))
    p2p.warm_up(mesh.pp, mesh.device)
    results = {}
    for name, vpp in schedules:
        cfg = load_config(
            MODEL
            + [
                f"parallel.pp={pp}",
                f"parallel.vpp={vpp}",
                f"train.global_batch_size={2 * m}",
                f"parallel.pp_schedule={name}",
            ],
            world_size=pp,
            check_data=False,
        )
        (model, opt), data = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh), run_samples(cfg)
        idle, step_s, costs = [], [], []
        for step in range(steps + 1):  # step 0 warms up
            batches = microbatches(data, step, BatchShape(2 * m, 2, cfg.train.seed), mesh)
            timeline = []
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            order = build_schedule(model.schedule, mesh.pp.size, cfg.parallel.vpp, m, mesh.pp.rank)
            run_schedule(order, model, batches, mesh, opt, 2 * m * 128, timeline)
            total = time.perf_counter() - t0
            if step:
                idle.append(1 - sum(e - s for _, s, e in timeline) / total)
                step_s.append(total)
                # a stage's F, B, W: the chunks' mean times x vpp (no W: the whole backward is B)
                costs.append([vpp * _mean([e - s for a, s, e in timeline if a.kind == k]) for k in "FBW"])
        results[name] = (_mean(idle), _mean(step_s), [_mean([c[i] for c in costs]) for i in range(3)])
    gathered = [None] * pp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def _mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    pp, m, steps = int(args.get("pp", 2)), int(args.get("microbatches", 8)), int(args.get("steps", 3))
    os.environ[ENV_VAR] = P2PSemantics(args.get("p2p", "native")).value  # the spawned ranks inherit it
    kinds = args.get("kinds", "1f1b,interleaved").split(",")
    # each kind at the fewest chunks per rank its rule admits (interleaved and zbv: 2, the others 1)
    schedules = [(k, (admitted_vpps(k, pp, m) or [1])[0]) for k in kinds]
    per_rank = spawn_local(_worker, pp, pp, m, steps, schedules, timeout_s=900)
    print(f"pp={pp} microbatches={m} cores={os.cpu_count()} p2p={os.environ[ENV_VAR]} (gloo, CPU, small GPT)")
    print(
        f"  {'schedule':<12} {'vpp':>3} {'step s':>8} "
        f"{'bubble':>7} {'sim':>7} {'meas/sim':>8} {'formula':>7}  "
        f"F:B:W measured (ms per stage)"
    )
    for name, vpp in schedules:
        measured = _mean([r[name][0] for r in per_rank])
        step = max(r[name][1] for r in per_rank)
        f, b, w = (_mean([r[name][2][i] for r in per_rank]) for i in range(3))
        sim = simulate(name, pp, vpp, m, SendModel.RENDEZVOUS, costs=Costs(f, b, w)).bubble
        print(
            f"  {name:<12} {vpp:>3} {step:>8.3f} {measured:>7.3f} "
            f"{sim:>7.3f} {measured / sim if sim else 0:>8.2f} "
            f"{(pp - 1) / (vpp * m + pp - 1):>7.3f}  {1e3 * f:.1f}:{1e3 * b:.1f}:{1e3 * w:.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
