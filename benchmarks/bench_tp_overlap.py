"""tp communication overlap on this machine (gloo, ranks as processes): the step time of one forward +
backward at tp2·sp with `parallel.tp_comm_overlap=true` against the unoverlapped path, measured in the
same run (the two models built side by side, timed in alternation so the machine's load hits both alike).

    python benchmarks/bench_tp_overlap.py [tp=2] [seq=2048] [hidden=512] [layers=2] [chunks=4] [steps=5]
                                          [threads=1]

Prints each path's fastest step (the least disturbed one on a shared machine; the slowest rank's time)
and the ratio unoverlapped / overlapped (above 1: overlap is faster). On CPU gloo's collectives run on
their own threads, so the overlap can hide transfers only where a core is free for them.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist

from megaframe.parallel.local import spawn_local


def _rank(
    rank: int, port: int, world: int, over: list[str], chunks: int, steps: int, threads: int, q
) -> None:
    from megaframe.config import load_config
    from megaframe.model.parallelize import build_model_for
    from megaframe.parallel.mesh import build_mesh

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = build_mesh(world, 1, torch.device("cpu"), timeout=datetime.timedelta(seconds=600))
    models = {}
    for name, extra in (
        ("plain", []),
        ("overlap", ["parallel.tp_comm_overlap=true", f"parallel.tp_comm_chunks={chunks}"]),
    ):
        c = load_config(over + extra, world_size=world, check_data=False)
        models[name] = build_model_for(c.model, c.parallel, c.train, c.optim, mesh)
    cfg = load_config(over, world_size=world, check_data=False)
    ids_BS = torch.randint(
        0, cfg.model.vocab_size, (1, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(0)
    )
    times = {k: [] for k in models}
    for r in range(steps + 1):
        for name in models if r % 2 == 0 else reversed(list(models)):
            dist.barrier()  # every rank starts together: the slowest rank's time is the group's
            t0 = time.perf_counter()
            models[name](ids_BS[:, :-1], ids_BS[:, 1:]).sum().backward()
            if r:  # round 0 is the warm-up
                times[name].append(time.perf_counter() - t0)
    t = torch.tensor([min(times["plain"]), min(times["overlap"])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        q.put(t.tolist())
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    a = {"tp": 2, "seq": 2048, "hidden": 512, "layers": 2, "chunks": 4, "steps": 5, "threads": 1}
    for arg in argv:
        k, v = arg.split("=", 1)
        if k not in a:
            print(f"bench_tp_overlap: unknown argument {k!r} (known: {', '.join(a)})", file=sys.stderr)
            return 2
        a[k] = int(v)
    over = [
        "data=synthetic",
        f"model.hidden_size={a['hidden']}",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        f"model.ffn_hidden_size={4 * a['hidden']}",
        "model.vocab_size=256",
        f"model.num_layers={a['layers']}",
        f"model.seq_length={a['seq']}",
        "model.dropout=0.0",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        f"parallel.tp={a['tp']}",
        "parallel.sp=true",
        "logging.wandb.mode=disabled",
    ]
    plain, overlap = spawn_local(_rank, a["tp"], a["tp"], over, a["chunks"], a["steps"], a["threads"])
    print(
        f"bench_tp_overlap | tp{a['tp']}·sp, seq {a['seq']}, D={a['hidden']}, {a['layers']} layers, "
        f"{a['chunks']} chunks, {a['threads']} thread(s) per rank | fastest of {a['steps']} steps"
    )
    print(f"  unoverlapped {plain * 1e3:9.1f} ms | overlapped {overlap * 1e3:9.1f} ms")
    print(f"ratio unoverlapped / overlapped: {plain / overlap:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
