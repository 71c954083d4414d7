"""One MoE block forward + backward at 1 and 4 sequences a micro-batch on this device, beside the planner's
time for the same block: does the block wait on its GPU or on its host?

    python benchmarks/bench_moe_block.py                     # CUDA: qwen3_30b_a3b's block, 4096 tokens a
                                                             # sequence, all 128 experts on the device (ep 1)
    python benchmarks/bench_moe_block.py --dry               # CPU, qwen3_moe_tiny: the harness (the suite)
    python benchmarks/bench_moe_block.py --dry --seq-length 1 --precision fp32 --seqs 1
                                                             # CPU, one token: the host's own time per op

Per micro-batch size, the median over --repeats of: gpu ms (CUDA events around forward + backward; on CPU the
wall time), host ms (until the last op is issued, before the closing sync: the dispatcher's host sync inside
forward is in it), aten ops issued (non-view, counted once by a dispatch mode: about the kernels a GPU runs),
the planner's ms for the block (planning/steptime: compute.block_seconds and timing.block_host_seconds,
the launches it exposes and the dispatcher's sync) on the device's table entry, and measured / planned. A
measured / planned well above 1 that host ms tracks says the step-time model's launch term (LAUNCH_S a kernel
over block_kernels' count) is short for this block: the published MoE runs' gap (docs/planning.md). Host us
a op is host ms over the ops: at one token in fp32 on the CPU the kernels do next to nothing, so it is the
eager dispatch's and autograd's own cost per op on this host (a GPU's host adds the CUDA launch to it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def _block(model_name: str, seqs: int, dry: bool, device: torch.device, seq: int, precision: str):
    from megaframe.config import load_config
    from megaframe.model.parallelize import build_model_for
    from megaframe.parallel.mesh import single_process_mesh

    # --dry: the tiny Qwen3-MoE (8 experts) at 32 tokens a sequence unless told
    if dry:
        model_name, seq = "qwen3_moe_tiny", seq or 32
    shape = [f"model.seq_length={seq}"] if seq else []
    over = [
        "data=synthetic",
        f"model={model_name}",
        "model.num_layers=1",
        *shape,
        f"train.precision={precision}",
    ]
    over += [f"train.micro_batch_size={seqs}", f"train.global_batch_size={seqs}"]
    over.append(f"train.device={device.type}")
    cfg = load_config(over, world_size=1, check_data=False)
    torch.manual_seed(0)
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, single_process_mesh(device))
    block, m = model.layers["0"].train(), cfg.model
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    x_SBD = torch.randn(m.seq_length, seqs, m.hidden_size, device=device, dtype=dtype)
    return cfg, block, x_SBD.requires_grad_(), model.rope_for(dtype)


def _measure(block, x_SBD, rope, repeats: int, device: torch.device) -> tuple[float, float, int]:
    """(gpu ms, host ms, non-view aten ops) of one forward + backward, medians over `repeats`."""
    cuda = device.type == "cuda"
    grad = torch.ones_like(x_SBD)

    def step():
        block(x_SBD, rope).backward(grad)

    for _ in range(2):  # warm-up: allocator, kernels chosen
        step()
    counter = _Ops()
    with counter:
        step()
    gpu, host = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()  # the events' time is read after the work ends
            gpu.append(start.elapsed_time(end))
        else:
            gpu.append(host[-1])
    return statistics.median(gpu), statistics.median(host), counter.n


def _planned_ms(cfg, seqs: int, device_name: str) -> float:
    """The step-time model's ms for this block and micro-batch on one rank: its GPU work and what the host
    adds to it (timing.block_host_seconds, as the step charges every block)."""
    from megaframe.planning.candidate import Layout
    from megaframe.planning.devices import get_device
    from megaframe.planning.steptime.compute import block_seconds
    from megaframe.planning.steptime.inputs import Step
    from megaframe.planning.steptime.timing import block_host_seconds

    dev = get_device(device_name)
    work = sum(block_seconds(cfg, dev, 1, 1, seqs, False, 1).values())
    one_rank = Step(cfg, Layout(1, 1, 1, 1, 1, 0, seqs, "none"), dev, 1)
    return (work + block_host_seconds(one_rank, work)) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device-entry", help="the planner's device (default: H100, or H200 on one)")
    ap.add_argument("--dry", action="store_true", help="CPU and a tiny shape")
    ap.add_argument(
        "--seq-length", type=int, default=0, help="tokens a sequence (default: the model's; 32 dry)"
    )
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    entry = args.device_entry or ("H200" if "H200" in name else "H100")
    model = "qwen3_moe_tiny" if args.dry else args.model
    print(f"MoE block of {model} on {name}; planned on the {entry} entry (planning/devices.py)")
    for seqs in args.seqs:
        cfg, block, x_SBD, rope = _block(args.model, seqs, args.dry, device, args.seq_length, args.precision)
        gpu, host, ops = _measure(block, x_SBD, rope, args.repeats, device)
        planned = _planned_ms(cfg, seqs, entry)
        print(
            f"  {seqs} x {cfg.model.seq_length} tokens: gpu {gpu:.2f} ms, host {host:.2f} ms, {ops} aten "
            f"ops ({host / ops * 1e3:.1f} us a op on the host), planned {planned:.2f} ms, ratio measured / "
            f"planned {gpu / planned:.2f}"
        )
        del block, x_SBD


if __name__ == "__main__":
    main()
