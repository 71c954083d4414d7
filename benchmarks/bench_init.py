"""Seconds and peak host memory of building (and initialising) one rank of a model on CPU, real tensors.

    PYTHONPATH=. python benchmarks/bench_init.py model=llama3_8b --tp 8 --pp 4 [--pp-rank 0] [--ep 1 --dp 1]

Each measurement runs in a fresh subprocess so ru_maxrss is that build's peak alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(args) -> None:
    import torch

    from megaframe.config import load_config
    from megaframe.model.parallelize import build_model_for
    from megaframe.parallel.virtual import virtual_mesh

    torch.set_num_threads(1)
    cfg = load_config(
        list(args.overrides)
        + [
            f"parallel.tp={args.tp}",
            f"parallel.pp={args.pp}",
            f"parallel.ep={args.ep}",
            "train.compile=false",
        ],
        world_size=args.tp * args.pp * args.dp,
        check_data=False,
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mesh = virtual_mesh(
        args.tp, args.pp, args.dp, tp_rank=args.tp_rank, pp_rank=args.pp_rank, device="cpu", ep=args.ep
    )
    t0 = time.perf_counter()
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    took = time.perf_counter() - t0
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(
        json.dumps(
            {
                "seconds": round(took, 2),
                "peak_rss_gib": round(peak / 2**20, 2),
                "rss_before_build_gib": round(base / 2**20, 2),
                "local_param_gib": round(local / 2**30, 2),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("overrides", nargs="*")
    for k, v in (("tp", 8), ("pp", 4), ("dp", 1), ("ep", 1), ("tp-rank", 0), ("pp-rank", 0)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    print(
        f"{' '.join(args.overrides)} tp{args.tp} pp{args.pp} "
        f"ep{args.ep} rank (pp {args.pp_rank}, tp {args.tp_rank}): "
        f"{out.stdout.strip()}"
    )


if __name__ == "__main__":
    main()
