"""Device specs for the planner's step-time model: one table, each figure with its source.

Peaks are dense (no sparsity) tensor-core FLOP/s; link bandwidths are per direction per device.
`efficiency` is the fraction of peak the model assumes a training step's large matmuls reach (stated, not
fitted: ~50 % is what well-tuned Megatron-LM / torchtitan bf16 runs of 8B-70B dense models report as
MFU on H100/A100, e.g. Llama 3's 38-43 % at 16k GPUs, Megatron's 47 % at 1T params on A100); `link_eff`
the fraction of the link rate NCCL's bus bandwidth reaches (nccl-tests all-reduce busbw, ~80 %).
`latency_s` is the per-message cost of one ring step (NCCL's few-microsecond launch + hop). `hbm_bw` and
`gemm_launch_s` make the efficiency a function of each GEMM's shape (planning.timing.gemm_efficiency): a
thin GEMM (large tp, a small micro-batch) is bound by memory or launch, not by the tensor cores.

"cpu" is measured when asked for (`measure_cpu`): the best fp32 matmul rate of one core, and the time
of one gloo ring hop against its size between two local processes (planning.gloo_link).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16: float
    """Dense bf16 FLOP/s per device."""
    peak_fp32: float
    """fp32 FLOP/s per device (TF32 tensor cores on GPUs, as PyTorch uses for fp32 matmuls when allowed)."""
    memory_gb: float
    intra_bw: float
    """Bytes/s per direction between devices of one node (NVLink)."""
    inter_bw: float
    """Bytes/s per direction per device between nodes (one InfiniBand NIC per GPU)."""
    per_node: int
    """Devices per node (the NVLink domain)."""
    efficiency: float = 0.5
    link_eff: float = 0.8
    latency_s: float = 10e-6
    hbm_bw: float = 0.0
    """Bytes/s of the device's own memory (the GEMM roofline's memory side, planning.timing.gemm_efficiency);
    0: no per-shape model, every GEMM at `efficiency`."""
    gemm_launch_s: float = 5e-6
    """Fixed cost of one GEMM kernel (launch and tail wave), the roofline's third term."""
    hops: tuple = ()
    """Measured ((bytes, seconds of one ring hop), ...) (cpu: gloo, planning.gloo_link); when set it
    replaces latency_s + bytes / bandwidth."""
    source: str = ""

    def peak(self, precision: str) -> float:
        return self.peak_bf16 if precision == "bf16" else self.peak_fp32


DEVICES = {
    "H100": Device("H100 SXM5 80GB", 989e12, 494.7e12, 80, 450e9, 50e9, 8, hbm_bw=3.35e12,
                   source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TF bf16 dense, 495 TF tf32 dense, "
                          "NVLink 900 GB/s bidirectional, HBM3 3.35 TB/s); DGX H100: 8 GPUs, ConnectX-7 400 Gb/s per GPU"),
    "H200": Device("H200 SXM 141GB", 989e12, 494.7e12, 141, 450e9, 50e9, 8, hbm_bw=4.8e12,
                   source="NVIDIA H200 Tensor Core GPU datasheet (same compute and NVLink as H100 SXM, 141 GB "
                          "HBM3e at 4.8 TB/s); HGX H200 with 400 Gb/s NDR per GPU"),
    "A100": Device("A100 SXM4 80GB", 312e12, 156e12, 80, 300e9, 25e9, 8, hbm_bw=2.039e12,
                   source="NVIDIA A100 Tensor Core GPU datasheet (312 TF bf16 dense, 156 TF tf32, NVLink 600 GB/s "
                          "bidirectional, HBM2e 2,039 GB/s); DGX A100: ConnectX-6 200 Gb/s HDR per GPU"),
    "B200": Device("B200 SXM 180GB", 2.25e15, 1.1e15, 180, 900e9, 50e9, 8, hbm_bw=8e12,
                   source="NVIDIA DGX B200 datasheet (72 PF fp8 training / 8 GPUs = 9 PF fp8 sparse, i.e. 2.25 PF "
                          "bf16 dense; 1,440 GB / 8; NVLink 5 1.8 TB/s bidirectional; HBM3e 64 TB/s / 8; "
                          "ConnectX-7 400 Gb/s per GPU)"),
}


def _matmul_rate(n: int = 512, seconds: float = 0.3) -> float:
    """Best fp32 matmul FLOP/s on one thread over a few windows (another process may share the core)."""
    threads = torch.get_num_threads()
    # one thread: the figure is per core, as the cpu device runs one rank per core
    torch.set_num_threads(1)
    try:
        a = torch.randn(n, n)
        # warm-up: thread pool start and page faults stay out of the timed windows
        torch.mm(a, a)
        best = 0.0
        # the best of five windows: another process on the core slows some of them, not all
        for _ in range(5):
            k, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 5:
                torch.mm(a, a)
                k += 1
            best = max(best, 2 * n**3 * k / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def measure_cpu(cores: int | None = None, link_timeout_s: float = 120.0) -> Device:
    """The "cpu" device: one rank per core, gloo between local processes, measured now. ValueError (one
    line) when the link measurement gets no answer within link_timeout_s."""
    import os

    from megaframe.planning.gloo_link import measure_hops

    rate = _matmul_rate()
    try:
        hops = measure_hops(link_timeout_s)
    except TimeoutError as e:
        raise ValueError(f"+device=cpu: the gloo link measurement failed: {e}; retry on a quieter machine, raise "
                         "+link_timeout_s, or plan for a table device (+device=H100, ...)") from None
    (s0, t0), (s1, t1) = hops[-2], hops[-1]
    bw = (s1 - s0) / (t1 - t0)  # the largest sizes' bandwidth, for the printed summary
    cores = cores or os.cpu_count() or 1
    return Device(f"cpu (measured: {rate / 1e9:.1f} GFLOP/s fp32 per core; gloo hop {hops[0][1] * 1e6:.0f} us "
                  f"for {hops[0][0]} B, {hops[-1][1] * 1e3:.1f} ms for {hops[-1][0] >> 20} MiB)", rate, rate, 0, bw, bw,
                  # link_eff 1: the link was measured, not taken from a datasheet peak
                  cores, efficiency=0.5, link_eff=1.0, latency_s=hops[0][1], hops=hops,
                  source="measured at start: best fp32 512x512 matmul rate on one thread; gloo all-gather and "
                  "reduce-scatter between two local processes, 4 B to 4 MiB per hop")


def get_device(name: str, link_timeout_s: float = 120.0, **overrides) -> Device:
    """A table entry by name (case-insensitive), or the measured "cpu" (its link measurement waits at most
    link_timeout_s); fields may be overridden."""
    key = name.upper()
    if name.lower() == "cpu":
        dev = measure_cpu(link_timeout_s=link_timeout_s)
    elif key in DEVICES:
        dev = DEVICES[key]
    else:
        raise ValueError(f"+device={name}: unknown (one of {', '.join(DEVICES)}, cpu)")
    return replace(dev, **{k: v for k, v in overrides.items() if v is not None})
