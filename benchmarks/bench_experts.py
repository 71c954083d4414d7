"""MoE experts: one grouped GEMM per projection against the per-expert loop it replaced, one process.

    python benchmarks/bench_experts.py [--experts 8] [--rows 4096] [--hidden 256] [--ffn 512]
                                       [--device cpu|cuda]
                                    [--dtype fp32|bf16] [--repeats 5]

Forward + backward of the local experts (SwiGLU, fused [gate | up]) on the same rows, split over the
experts by a skewed routing (as real routers are), interleaved repeats; prints the median time of each
and the ratio loop / grouped (above 1: the grouped GEMM is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from megaframe.config import load_config
    from megaframe.model.moe.layer import Experts
    from megaframe.parallel.mesh import single_process_mesh

    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = load_config(
        [
            "data=synthetic",
            "model=moe_tiny",
            "model.vocab_size=64",
            f"model.num_experts={args.experts}",
            f"model.hidden_size={args.hidden}",
            f"model.moe_ffn_hidden_size={args.ffn}",
        ],
        world_size=1,
    )
    experts = Experts(cfg.model, single_process_mesh(device), False, device).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    share = torch.arange(args.experts, 0, -1, dtype=torch.float64)  # skewed: expert 0 gets the most rows
    sizes = (share / share.sum() * args.rows).floor().long().tolist()
    sizes[0] += args.rows - sum(sizes)
    x = torch.randn(args.rows, args.hidden, device=device, dtype=dtype, requires_grad=True)

    def step(fn):
        fn(x, sizes).float().square().mean().backward()

    sides = {"grouped": experts.forward, "loop": experts.forward_loop}
    times = {k: [] for k in sides}
    for _name, fn in sides.items():
        step(fn)  # warm-up
    for r in range(args.repeats):
        for name, fn in sides.items() if r % 2 == 0 else reversed(list(sides.items())):
            times[name].append(timed(lambda fn=fn: step(fn), device))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"bench_experts | {device.type} {args.dtype}, "
        f"{torch.get_num_threads()} thread(s) | {args.experts} experts, "
        f"{args.rows} rows (largest {max(sizes)}), D={args.hidden}, F={args.ffn} | {args.repeats} repeats"
    )
    for k, v in med.items():
        print(f"  {k:8s} fwd+bwd median {v * 1e3:8.2f} ms")
    print(f"ratio loop / grouped: {med['loop'] / med['grouped']:.2f}")


if __name__ == "__main__":
    main()
