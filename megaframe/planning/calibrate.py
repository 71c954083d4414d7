"""`python -m megaframe.plan calibrate [--out PATH] [--quick]`: measure this machine's device and write a
profile (planning.devices.Device as JSON) that `+device_profile=PATH` then plans with.

Measured on the present device (CUDA if there is one, else one CPU core): bf16 GEMM throughput over a
sweep of square sizes (the largest's fraction of the rated peak is `efficiency`, and `gemm_fixed_s` is the
fixed time that fits the smallest one: the size curve planning.steptime.compute uses); causal SDPA's forward +
backward rate (`attn_eff`); a device-to-device copy's bandwidth (`hbm_bw`, hbm_eff 1: measured). On CPU the
peak is the measured matmul rate itself (torch's kernels are the device) and the link is gloo between two
local processes (planning.gloo_link); on a GPU the rated peak comes from training.metrics.GPU_PEAK and the
links, which one GPU cannot measure, from the nearest table entry (named in the profile's source).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch


def _timed(fn, device: str, seconds: float) -> float:
    """Best seconds of one call over a few windows (warm-up first)."""
    fn()
    best = float("inf")
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0, k = time.perf_counter(), 0
        while k == 0 or time.perf_counter() - t0 < seconds / 3:
            fn()
            k += 1
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / k)
    return best


def gemm_sweep(device: str, dtype, sizes: list[int], seconds: float) -> list[tuple[int, float]]:
    """(n, FLOP/s of an n x n x n GEMM) for each size."""
    out = []
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        out.append((n, 2 * n**3 / _timed(lambda a=a, b=b: a @ b, device, seconds)))
    return out


def attention_rate(device: str, dtype, seq: int, heads: int, dim: int, seconds: float) -> float:
    """Causal SDPA forward + backward in model FLOPs/s (half the square: 4·S²·H·d forward x 3 / 2)."""
    q, k, v = (
        torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 3 * 4 * seq * seq * heads * dim / 2 / _timed(step, device, seconds)


def copy_bandwidth(device: str, nbytes: int, seconds: float) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, seconds)  # read + write


def calibrate(quick: bool) -> dict:
    from megaframe.planning.devices import DEVICES, measure_cpu
    from megaframe.training.metrics import gpu_peak

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    secs = 0.05 if quick else 0.5
    sizes = [256, 512] if quick else ([1024, 2048, 4096, 8192] if cuda else [256, 512, 1024])
    sweep = gemm_sweep(device, dtype, sizes, secs)
    attn = attention_rate(
        device, dtype, 256 if quick else (4096 if cuda else 512), 4 if quick else 16, 64, secs
    )
    if cuda:
        name = torch.cuda.get_device_name(0)
        peak = gpu_peak(name) or max(r for _, r in sweep)
        base = next((d for k, d in DEVICES.items() if k.split("_")[0] in name), DEVICES["H100"])
        base = replace(
            base,
            name=f"{name} (calibrated)",
            peak_bf16=peak,
            memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30,
            source=f"calibrated here; links from the {base.name} table entry",
        )
    else:
        base = measure_cpu()
        peak = max(r for _, r in sweep)
        base = replace(base, peak_bf16=peak, peak_fp32=peak)
    eff = max(r for _, r in sweep) / peak
    n0, r0 = sweep[0]
    f0 = 2 * n0**3
    fixed = max(f0 / r0 - f0 / (peak * eff), 0.0)  # the small GEMM's time beyond the large ones' rate
    hbm = copy_bandwidth(device, (1 << 24) if quick else (1 << 28 if cuda else 1 << 26), secs)
    dev = replace(
        base,
        efficiency=min(eff, 1.0),
        gemm_fixed_s=fixed,
        attn_eff=min(attn / peak, 1.0),
        hbm_bw=hbm if cuda else 0.0,
        hbm_eff=1.0,
    )
    prof = dev.to_dict()
    prof["measured"] = {"gemm_flops": sweep, "attention_flops": attn, "copy_bytes_per_s": hbm}
    return prof


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megaframe.plan calibrate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", default="device_profile.json", help="where the profile is written")
    ap.add_argument("--quick", action="store_true", help="small sizes and short windows (a smoke test)")
    args = ap.parse_args(argv)
    from megaframe.errors import fail, write_refused

    out = Path(args.out)
    if out.is_dir() or not out.parent.exists():
        return fail(f"calibrate --out={args.out}: not a file in an existing folder")
    prof = calibrate(args.quick)
    measured = prof.pop("measured")
    try:
        out.write_text(json.dumps({**prof, "measured": measured}, indent=1))
    except OSError as e:  # a full disk: exit 1 as every tool (docs/checkpoints.md); another refusal: 2
        code = 1 if write_refused(e) else 2
        return fail(f"calibrate --out={args.out}: cannot write the profile ({e})", code=code)
    print(
        f"calibrated {prof['name']}: GEMM {max(r for _, r in measured['gemm_flops']) / 1e12:.2f} TFLOP/s "
        f"(efficiency {prof['efficiency']:.2f}, fixed {prof['gemm_fixed_s'] * 1e6:.1f} us), attention "
        f"{measured['attention_flops'] / 1e12:.3f} TFLOP/s; wrote {out} (use +device_profile={out})"
    )
    return 0
