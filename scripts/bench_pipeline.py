"""Measured pipeline bubble on gloo (CPU): idle time / step time per rank, 1F1B vs interleaved.

    python scripts/bench_pipeline.py [pp=2] [microbatches=8] [steps=3] [p2p=native|nccl]

Spawns pp ranks (1 thread each), trains a small GPT for a few steps under each schedule and reports,
per schedule, the measured idle fraction (1 - compute time / step time, averaged over ranks and the
timed steps) next to the formula (pp-1)/(vpp*m+pp-1) and the simulator's figure for the measured
backward/forward time ratio under rendezvous sends. `p2p=nccl` runs the transfers under NCCL's
rules emulated on gloo (MEGAFRAME_P2P_SEMANTICS, parallel/p2p_semantics.py). On a machine with fewer
cores than ranks the ranks share cores and the measurement mixes bubble with contention: use pp <= cores.
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
from megaframe.pipeline.simulate import SendModel, simulate

MODEL = ["data=synthetic", "model.num_layers=8", "model.hidden_size=256", "model.num_attention_heads=8",
         "model.num_query_groups=4", "model.ffn_hidden_size=704", "model.seq_length=128",
         "model.vocab_size=1024", "train.micro_batch_size=2", "logging.wandb.mode=disabled"]


def _worker(rank: int, port: int, pp: int, m: int, steps: int, schedules: list, out) -> None:
    from megaframe.config import load_config
    from megaframe.data.dataset import build_data, microbatches
    from megaframe.model.gpt import build_model
    from megaframe.optim.build import build_optimizer
    from megaframe.parallel.mesh import build_mesh
    from megaframe.pipeline import p2p
    from megaframe.pipeline.executor import run_schedule
    from megaframe.training.step import rank_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp,
                            timeout=datetime.timedelta(seconds=120))
    mesh = build_mesh(1, pp, torch.device("cpu"))
    p2p.warm_up(mesh.pp, mesh.device)
    results = {}
    for name, vpp in schedules:
        cfg = load_config(MODEL + [f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"train.global_batch_size={2 * m}"],
                          world_size=pp, check_data=False)
        model, data = build_model(cfg, mesh), build_data(cfg)
        opt = build_optimizer(model, cfg.optim, mesh)
        idle, ratio = [], []
        for step in range(steps + 1):  # step 0 warms up
            batches = microbatches(data, step, 2 * m, 2, 0, 1, cfg.train.seed)
            timeline = []
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            run_schedule(rank_schedule(cfg, mesh, m), model, batches, mesh, opt, 2 * m * 128, timeline)
            total = time.perf_counter() - t0
            if step:
                idle.append(1 - sum(e - s for _, s, e in timeline) / total)
                f = [e - s for a, s, e in timeline if a.kind == "F"]
                b = [e - s for a, s, e in timeline if a.kind == "B"]
                ratio.append((sum(b) / len(b)) / (sum(f) / len(f)))
        results[name] = (sum(idle) / len(idle), sum(ratio) / len(ratio))
    gathered = [None] * pp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    pp, m, steps = int(args.get("pp", 2)), int(args.get("microbatches", 8)), int(args.get("steps", 3))
    os.environ[ENV_VAR] = P2PSemantics(args.get("p2p", "native")).value  # the spawned ranks inherit it
    schedules = [("1f1b", 1), ("interleaved", 2)]
    per_rank = spawn_local(_worker, pp, pp, m, steps, schedules, timeout_s=900)
    print(f"pp={pp} microbatches={m} cores={os.cpu_count()} p2p={os.environ[ENV_VAR]} (gloo, CPU)")
    for name, vpp in schedules:
        measured = sum(r[name][0] for r in per_rank) / pp
        ratio = sum(r[name][1] for r in per_rank) / pp
        formula = (pp - 1) / (vpp * m + pp - 1)
        sim = simulate(name, pp, vpp, m, SendModel.RENDEZVOUS, backward_time=max(1, round(ratio))).bubble
        print(f"  {name:<12} vpp={vpp}: measured bubble {measured:.3f} | formula {formula:.3f} | "
              f"simulated (B/F={max(1, round(ratio))}, rendezvous) {sim:.3f} | B/F measured {ratio:.2f} | "
              f"per rank {[round(r[name][0], 3) for r in per_rank]}")


if __name__ == "__main__":
    main(sys.argv[1:])
