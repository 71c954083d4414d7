"""Figures a user checks a run by: model FLOPs per token (for MFU) and per-rank memory.

MFU definition (one, used everywhere: metrics.jsonl, bench_vs_hf, describe()):

    mfu = tokens_per_s * flops_per_token / (world_size * peak_flops_per_device)
    tflops_per_device = tokens_per_s * flops_per_token / world_size / 1e12

flops_per_token = 3 * forward FLOPs per token (backward = 2x forward: grads of inputs and of
weights), PaLM / Megatron "model FLOPs": what the model needs, never what an implementation spends
(activation recompute, padding, communication and the optimizer are not counted):

    flops_per_token = 6 * N_matmul + 12 * L * S * (H * E)

  N_matmul  weights of every matmul one token passes through, per layer
              attention  D * (H + 2 * K) * E   fused QKV, GQA: K kv heads of dim E   (K = H: MHA)
                         H * E * D             output projection
              MLP        3 * D * F             SwiGLU (gate, up, down)   | 2 * D * F  GELU (up, down)
              MoE        top_k * (3 | 2) * D * F_moe + D * num_experts   only the top_k experts a
                         token is routed to, plus the router (F_moe = model.moe_ffn_hidden_size, else F)
            plus the output head V * D (counted tied or not: the logits matmul runs either way); the
            input embedding is a lookup and is not counted; norms, biases, RoPE, softmax are ignored.
  attention core  QK^T and AV: 2 matmuls x 2 FLOPs x S x (H * E) per token per layer forward, so
            3 * 4 = 12 * L * S * H * E per token for the step. Counted FULL (the whole S x S score
            matrix), without the causal 1/2 discount, as Megatron-LM and the PaLM appendix do, so MFU is
            comparable with published figures (`causal=True` gives the halved count).

For a dense GPT-3-style model (F = 4D, H * E = D) this is Megatron-LM's 72 * B * S * L * D^2 *
(1 + S / (6 D) + V / (12 L D)) per B*S tokens (Korthikanti et al. 2022, eq. for model FLOPs), and
PaLM's 6N + 12 * L * H * Q * T (Chowdhery et al. 2022, appendix B); tests/unit check both.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from megaframe.atomic import write_atomic
from megaframe.config.schema import ModelConfig

# dense bf16 tensor-core peaks (no sparsity), FLOP/s
GPU_PEAK = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}
"""Dense bf16 FLOP/s by device-name substring, the first match wins: the PCIe and NVL cards come before
the SXM/HBM3 parts ("NVIDIA H100 80GB HBM3"), whose 989 TF would overstate their MFU by 1.31x / 1.18x."""


def gpu_peak(name: str) -> float:
    """GPU_PEAK's figure for a torch.cuda device name; 0 when unknown."""
    return next((v for k, v in GPU_PEAK.items() if k in name), 0.0)


def matmul_params(cfg: ModelConfig) -> int:
    """N_matmul of the module docstring: matmul weights one token meets (MoE: only its top_k experts), as
    the model family counts them (models/counts.py)."""
    from megaframe.models.registry import spec_of

    return spec_of(cfg).matmul_params(cfg)


def flops_per_token(cfg: ModelConfig, causal: bool = False) -> float:
    """Model FLOPs per trained token (forward + backward), the module docstring's formula (the family's)."""
    from megaframe.models.registry import spec_of

    return spec_of(cfg).flops_per_token(cfg, causal)


def throughput_figures(tokens_per_s: float, fpt: float, world: int, peak: float) -> dict[str, float]:
    """`tflops_per_device` (model TFLOP/s per rank) and `mfu`: None (not reported) when the peak is
    unknown, or when the rate exceeds it (then the peak, not the run, is wrong)."""
    per_device = tokens_per_s * fpt / world
    return {
        "tflops_per_device": per_device / 1e12,
        "mfu": per_device / peak if 0 < per_device <= peak else None,
    }


def peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device: dense bf16 from GPU_PEAK by torch.cuda device name (0 = unknown: mfu
    is not reported); on CPU the fp32 matmul rate of this machine at this rank's thread count, measured
    once and cached (cpu_peak_flops)."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device))
    return cpu_peak_flops()


# --- CPU peak: measured once per machine, cached in the user cache folder -----------------------------
CPU_PEAK_REPS = 200
"""Timed 512^3 matmuls (after warm-up); the fastest one is the peak. One takes ~1-2 ms, shorter than a
scheduler time slice, so even on a shared machine many run with the core to themselves: the fastest of
200 read the idle figure at a load average of 38 on 2 cores (164.5 GFLOP/s against 163.6 idle), where
the fastest 1024^3 matmul read 35 and the old best-of-five 50 ms windows at start-up a busy machine's
share (MFU then showed 77-200 %)."""


def cpu_peak_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megaframe" / "cpu_peak.json"


def _cpu_key() -> str:
    """What the peak depends on: the machine, its CPU, the rank's thread count and torch's kernels."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu
        )
    return f"{platform.node()}|{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|fp32"


def measure_cpu_peak(reps: int = CPU_PEAK_REPS, n: int = 512) -> float:
    a = torch.randn(n, n)
    out = torch.empty(n, n)
    for _ in range(3):  # warm-up: thread pool start, page faults
        torch.mm(a, a, out=out)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, a, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best  # a multiply and an add per term


def cpu_peak_flops(refresh: bool = False) -> float:
    """The cached CPU peak for this machine, measured (~1-2 s) on first use; 0 (mfu not reported) when
    the cache folder cannot be written, so an unmeasured guess is never logged."""
    path, key = cpu_peak_cache(), _cpu_key()
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        cache = {}
    if key in cache and not refresh:
        return float(cache[key])
    peak = measure_cpu_peak()
    cache[key] = peak
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(cache, indent=1))  # ranks may race on the cache: last rename wins
    except OSError:
        return 0.0
    return peak


def forget_cpu_peak() -> None:
    """Drop this machine's cached peak (a step ran faster than it: it was measured on a busy machine)."""
    path = cpu_peak_cache()
    # a best-effort drop: a missing or unreadable cache simply stays as it is
    with contextlib.suppress(OSError, ValueError):
        cache = json.loads(path.read_text())
        cache.pop(_cpu_key(), None)
        write_atomic(path, json.dumps(cache, indent=1))


# --- end CPU peak --------------------------------------------------------------------------------------


def memory_figures(model: nn.Module, optimizer, device: torch.device) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (and the CUDA peak)."""
    out = {
        "mem/params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **optimizer.memory_bytes(),
    }
    if device.type == "cuda":
        out["mem/peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out
