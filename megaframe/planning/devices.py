"""Device specs for the planner's step-time model: one table, each figure with its source.

Peaks are dense (no sparsity) tensor-core FLOP/s; link bandwidths are per direction per device. Datasheet
figures are quoted; the rest are read off published microbenchmarks, named beside each, never fitted to
the validation runs (docs/planning.md's published-run table is a held-out check of these figures):

  efficiency     the fraction of peak a large bf16 GEMM reaches in cuBLAS (the top of the efficiency
                 curve). A100: ~265 of 312 TF for 8192^3 (Anthony et al. 2024, arXiv 2401.14489, fig. 2;
                 NVIDIA "Matrix Multiplication Background" user guide); H100 SXM: ~740 of 989 TF
                 (the same paper's H100 sweep). FP8 GEMMs reach about the same fraction of the fp8 peak.
  gemm_fixed_s   the time a GEMM costs beyond its FLOPs at that rate (launch, the partial last wave of
                 tiles): the curve over size, efficiency x f / (f + efficiency x peak x fixed). ~8 us puts
                 a 2048^3 bf16 GEMM at ~0.74 of peak on A100 and ~0.56 on H100, as the same sweeps show.
  attn_eff       fused causal attention (forward + backward) as a fraction of peak: FlashAttention-2
                 (Dao 2023, arXiv 2307.08691: 50-73 % of A100's peak; ~35 % of H100's, which FA2 under
                 PyTorch SDPA runs at).
  hbm_eff        the fraction of HBM bandwidth a streaming (elementwise) kernel reaches (~0.8 in STREAM-like
                 tests of A100/H100, e.g. the same paper's memory-bound sweeps).
  link_eff       NCCL bus bandwidth over the link rate (nccl-tests all-reduce busbw, ~80 %).
  alloc_headroom the caching allocator's reserved bytes over the allocated peak the phases plan (what
                 torch.cuda.max_memory_reserved reads over max_memory_allocated; torchtitan reports the
                 reserved figure). ALLOC_HEADROOM on every GPU, an assumption, not a measurement: torchtitan
                 runs with PYTORCH_ALLOC_CONF=expandable_segments:True (its run_train.sh), whose segments
                 map physical memory in 2 MiB pages as they grow (pytorch/pytorch#96995), so what stays
                 reserved beyond the live peak is the free holes between live blocks. Without expandable
                 segments per-parameter FSDP on LLaMA-7B measured 1.27-1.35 x (meta-llama/llama-recipes
                 #41 and #165: peak reserved over peak active), an upper bound not used here. The cpu: 0
                 (no caching allocator; the phases are what the host allocator hands out).
  peak_fp32_cores  a float32 matmul without TF32 (torch's default "highest" precision, which megaframe
                 keeps: the MoE router's fp32 GEMM): the datasheets' fp32 figure (B200's DGX datasheet has
                 none: 0, peak_fp32 stands in).
  latency_s / inter_latency_s   per ring step on NVLink / across nodes on InfiniBand (nccl-tests small-message
                 all-reduce: ~10 us on 8 NVLink GPUs over 14 steps, ~2-3 us a step; ~5 us a step over IB).

"cpu" is measured when asked for (`measure_cpu`): the best fp32 matmul rate of one core, and the time
of one gloo ring hop against its size between two local processes (planning.gloo_link).
`python -m megaframe.plan calibrate` measures the present device and writes a profile (planning.calibrate)
that `+device_profile=PATH` loads in place of a table entry.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from megaframe.config.rules import NONNEGF, POS, POSF, SHARE, UNIT, Rule, check_option, describe

ALLOC_HEADROOM = 0.03
"""Reserved over allocated on a GPU under expandable segments (module doc: an assumption, one for all)."""


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16: float
    """Dense bf16 FLOP/s per device."""
    peak_fp32: float
    """fp32 FLOP/s per device: TF32 tensor cores on GPUs, as PyTorch runs fp32 matmuls when allowed, which
    megaframe does not allow (peak("tf32")); an fp32 run's GEMMs are timed at peak_fp32_cores, this where
    that is not known (the cpu's measured rate, B200)."""
    memory_gb: float
    intra_bw: float
    """Bytes/s per direction between devices of one node (NVLink)."""
    inter_bw: float
    """Bytes/s per direction per device between nodes (one InfiniBand NIC per GPU)."""
    per_node: int
    """Devices per node (the NVLink domain)."""
    efficiency: float = 0.5
    """Fraction of peak the largest GEMMs reach (the top of the curve; module doc)."""
    link_eff: float = 0.8
    latency_s: float = 3e-6
    """Seconds per ring step within a node (NVLink)."""
    hbm_bw: float = 0.0
    """Bytes/s of the device's own memory (the GEMM roofline's memory side and the elementwise work);
    0: no per-shape model, every GEMM at `efficiency` (the cpu)."""
    gemm_fixed_s: float = 8e-6
    """A GEMM's cost beyond its FLOPs at `efficiency` (launch, tail wave): the curve over size."""
    hops: tuple = ()
    """Measured ((bytes, seconds of one ring hop), ...) (cpu: gloo, planning.gloo_link); when set it
    replaces latency_s + bytes / bandwidth."""
    source: str = ""
    peak_fp8: float = 0.0
    """Dense fp8 FLOP/s (0: no fp8 tensor cores; fp8 runs at the bf16 peak)."""
    attn_eff: float = 0.4
    """Fused causal attention's forward + backward as a fraction of the bf16 peak."""
    hbm_eff: float = 0.8
    inter_latency_s: float = 5e-6
    """Seconds per ring step across nodes (InfiniBand)."""
    peak_fp32_cores: float = 0.0
    """fp32 FLOP/s of the CUDA cores (no TF32): where a float32 matmul runs under torch's default
    "highest" float32 matmul precision, which megaframe leaves as it is (the MoE router's fp32 GEMM,
    moe/router.py); 0: not known, peak_fp32 is used."""
    alloc_headroom: float = 0.0
    """Fraction of the allocated peak the caching allocator keeps reserved on top (fragmentation; module
    doc). planning.memory.phases' peaks are allocated bytes, what torch.cuda.max_memory_allocated reads; the
    published comparison and the plan's `reserved` line add this."""

    def peak(self, precision: str) -> float:
        """Dense FLOP/s at a precision. "fp32" (and "fp32_cores") is a float32 matmul as megaframe runs it,
        without TF32 (torch's default "highest" float32 matmul precision, which megaframe never lowers):
        peak_fp32_cores where known; "tf32" is the TF32 tensor cores' peak_fp32."""
        if precision in ("fp32", "fp32_cores"):
            return self.peak_fp32_cores or self.peak_fp32
        if precision == "fp8":
            return self.peak_fp8 or self.peak_bf16
        return self.peak_bf16 if precision == "bf16" else self.peak_fp32

    def to_dict(self) -> dict:
        return {**asdict(self), "hops": [list(h) for h in self.hops]}


_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TF bf16 dense, 1,979 TF fp8 dense, 495 TF tf32 dense, "
    "67 TF fp32, "
    "NVLink 900 GB/s bidirectional, HBM3 3.35 TB/s); DGX H100: 8 GPUs, ConnectX-7 400 Gb/s per GPU"
)
DEVICES = {
    "H100": Device(
        "H100 SXM5 80GB",
        989e12,
        494.7e12,
        80,
        450e9,
        50e9,
        8,
        efficiency=0.75,
        hbm_bw=3.35e12,
        peak_fp8=1979e12,
        attn_eff=0.35,
        peak_fp32_cores=67e12,
        alloc_headroom=ALLOC_HEADROOM,
        source=_H100,
    ),
    "H100_500W": Device(
        "H100 SXM 96GB HBM2e at 500 W",
        989e12,
        494.7e12,
        95,
        450e9,
        50e9,
        8,
        efficiency=0.62,
        hbm_bw=2.4e12,
        peak_fp8=1979e12,
        attn_eff=0.3,
        peak_fp32_cores=67e12,
        alloc_headroom=ALLOC_HEADROOM,
        source="torchtitan docs/performance.md's Grand Teton hosts (8 H100 with 96 GB HBM2e at "
        "2.4 TB/s, NVLink, 400 Gb/s RDMA per GPU, the default 500 W power limit); peaks "
        "from the H100 SXM datasheet. The 500 W cap lowers the sustained tensor-core "
        "clock: assumed 0.83 of the 700 W part's GEMM rate (clock ~ power^0.5), an "
        "assumption, not a measurement",
    ),
    "H200": Device(
        "H200 SXM 141GB",
        989e12,
        494.7e12,
        141,
        450e9,
        50e9,
        8,
        efficiency=0.75,
        hbm_bw=4.8e12,
        peak_fp8=1979e12,
        attn_eff=0.35,
        peak_fp32_cores=67e12,
        alloc_headroom=ALLOC_HEADROOM,
        source="NVIDIA H200 Tensor Core GPU datasheet (same compute, 67 TF fp32, and NVLink as H100 SXM, "
        "141 GB HBM3e at 4.8 TB/s); HGX H200 with 400 Gb/s NDR per GPU",
    ),
    "A100": Device(
        "A100 SXM4 80GB",
        312e12,
        156e12,
        80,
        300e9,
        25e9,
        8,
        efficiency=0.85,
        hbm_bw=2.039e12,
        attn_eff=0.55,
        peak_fp32_cores=19.5e12,
        alloc_headroom=ALLOC_HEADROOM,
        source="NVIDIA A100 Tensor Core GPU datasheet (312 TF bf16 dense, 156 TF tf32, 19.5 TF fp32, no fp8, "
        "NVLink 600 GB/s bidirectional, HBM2e 2,039 GB/s); DGX A100: ConnectX-6 200 Gb/s HDR per GPU",
    ),
    "B200": Device(
        "B200 SXM 180GB",
        2.25e15,
        1.1e15,
        180,
        900e9,
        50e9,
        8,
        efficiency=0.75,
        hbm_bw=8e12,
        peak_fp8=4.5e15,
        attn_eff=0.35,
        alloc_headroom=ALLOC_HEADROOM,
        source="NVIDIA DGX B200 datasheet (72 PF fp8 training / 8 GPUs = 9 PF fp8 sparse, i.e. 4.5 PF "
        "fp8 and 2.25 PF bf16 dense; 1,440 GB / 8; NVLink 5 1.8 TB/s bidirectional; HBM3e "
        "64 TB/s / 8; ConnectX-7 400 Gb/s per GPU); GEMM and attention efficiencies assumed "
        "as H100's (no public sweep found)",
    ),
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

    from megaframe.planning.gloo_link import measure_hops, tail_seconds_per_byte

    rate = _matmul_rate()
    try:
        hops = measure_hops(link_timeout_s)
    except TimeoutError as e:
        raise ValueError(
            f"+device=cpu: the gloo link measurement failed: {e}; retry on a quieter machine, raise "
            "+link_timeout_s, or plan for a table device (+device=H100, ...)"
        ) from None
    bw = 1 / tail_seconds_per_byte(hops)  # the largest sizes' bandwidth, for the printed summary
    cores = cores or os.cpu_count() or 1
    return Device(
        f"cpu (measured: {rate / 1e9:.1f} GFLOP/s fp32 per core; gloo hop {hops[0][1] * 1e6:.0f} us "
        f"for {hops[0][0]} B, {hops[-1][1] * 1e3:.1f} ms for {hops[-1][0] >> 20} MiB)",
        rate,
        rate,
        0,
        bw,
        bw,
        # link_eff 1: the link was measured, not taken from a datasheet peak
        cores,
        efficiency=0.5,
        link_eff=1.0,
        latency_s=hops[0][1],
        hops=hops,
        source="measured at start: best fp32 512x512 matmul rate on one thread; gloo all-gather and "
        "reduce-scatter between two local processes, 4 B to 4 MiB per hop",
    )


def get_device(name: str, link_timeout_s: float = 120.0, **overrides) -> Device:
    """A table entry by name (case-insensitive), or the measured "cpu" (its link measurement waits at most
    link_timeout_s); fields may be overridden."""
    key = name.upper().replace(" ", "_")
    if name.lower() == "cpu":
        dev = measure_cpu(link_timeout_s=link_timeout_s)
    elif key in DEVICES:
        dev = DEVICES[key]
    else:
        raise ValueError(f"+device={name}: unknown (one of {', '.join(DEVICES)}, cpu)")
    return replace(dev, **{k: v for k, v in overrides.items() if v is not None})


PROFILE_RULES: dict[str, Rule] = {
    "peak_bf16": POSF,  # divisors of the step-time model: a 0 was a ZeroDivisionError
    "peak_fp32": POSF,
    "memory_gb": NONNEGF,  # 0: not known (the measured cpu); +device_memory_gb then says it
    "intra_bw": POSF,
    "inter_bw": POSF,
    "per_node": POS,
    "efficiency": SHARE,
    "link_eff": SHARE,
    "latency_s": NONNEGF,
    "hbm_bw": NONNEGF,  # 0: no per-shape memory model (Device.hbm_bw)
    "gemm_fixed_s": NONNEGF,
    "peak_fp8": NONNEGF,  # 0: no fp8 tensor cores
    "attn_eff": SHARE,
    "hbm_eff": SHARE,
    "inter_latency_s": NONNEGF,
    "alloc_headroom": UNIT,
    "peak_fp32_cores": NONNEGF,  # 0: not known (peak_fp32 stands in)
}
"""Every numeric Device field's allowed values (config/rules.py's rules; tests check that each numeric
field has one): a hand-edited or truncated profile with a 0, a nan, a negative or a text figure is refused
naming the field, never planned into a traceback or a `nan s` step time."""


def check_profile(raw: dict, shown: str) -> dict:
    """The profile's fields, each of the right type and in its range (PROFILE_RULES; the names text, the
    hops a rising curve of positive (bytes, seconds) pairs); ValueError `<shown>: <field>=<value> must`."""
    out = dict(raw)
    for key in ("name", "source"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"{shown}: {key}={json.dumps(raw[key])} must be text")
    for key, rule in PROFILE_RULES.items():
        if key in raw:
            v, at = raw[key], f"{shown}: {key}={json.dumps(raw[key])}"
            if isinstance(v, str):  # "80" or "abc": a number in the JSON, never text read as one
                raise ValueError(f"{at} must be {describe(rule)}, not text")
            out[key] = check_option(at, v, rule)
    hops = raw.get("hops", ())
    try:
        curve = tuple((check_option("", b, POS), check_option("", t, POSF)) for b, t in hops)
    except (TypeError, ValueError):
        curve = None
    if curve is None or len(curve) == 1 or any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
        raise ValueError(
            f"{shown}: hops={json.dumps(hops)[:80]} must be [[bytes, seconds], ...], positive, bytes rising"
        )
    out["hops"] = curve
    return out


def load_profile(path: str, **overrides) -> Device:
    """A device profile written by `python -m megaframe.plan calibrate` (planning.calibrate); ValueError
    names the file and what is wrong with it (a field: PROFILE_RULES)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"+device_profile={path}: not a readable JSON profile ({e})") from None
    known = {f.name for f in fields(Device)}
    if isinstance(raw, dict):
        raw.pop("measured", None)  # calibrate's raw readings, kept beside the fields for the reader
    if (
        not isinstance(raw, dict)
        or not {"name", "peak_bf16", "peak_fp32"} <= raw.keys()
        or raw.keys() - known
    ):
        raise ValueError(f"+device_profile={path}: not a device profile (keys {sorted(known)})")
    raw = check_profile(raw, f"+device_profile={path}")
    try:
        dev = Device(**raw)
    except TypeError as e:
        raise ValueError(f"+device_profile={path}: {e}") from None
    return replace(dev, **{k: v for k, v in overrides.items() if v is not None})
