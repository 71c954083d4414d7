"""The one prepared GPU check: tests/gpu, then the speed figures, one line per check and a summary.

    python scripts/gpu_check.py                 # on a GPU host: everything (about 6 minutes on one H100)
    python scripts/gpu_check.py --dry           # CPU, tiny sizes: the same checks, to prove the harness (the
                                                  suite runs it)
    python scripts/gpu_check.py --only tests    # or: benches; extra arguments after -- go to pytest

The checks:
- tests/gpu (pytest): device syncs per step (none dense; one per MoE layer and micro-batch), flash
  attention on the model's call, the fused cross-entropy in bf16, the watchdog's CUDA events, checkpoint
  round trips, CPU vs CUDA losses, grouped experts against the loop, compiled FP8 against bf16, the
  overlapped pipeline kind's side stream and threads against 1f1b;
- bench_gpu A: the llama_1b shape (8 of 16 layers, 8 micro-batches of 2 x 2048 per step), megaframe against
  compiled transformers and compiled torchtitan: tokens/s, MFU, peak memory, per-step vs per-micro-batch ms;
- bench_gpu B: all 16 layers, megaframe fp8 against bf16;
- bench_vs_hf: a llama_1b-shaped step (8 of its 16 layers, so three models share one 80 GB GPU) compiled,
  megaframe bf16 and FP8 against transformers in the same run: tokens/s, MFU, the ratios;
- bench_experts: the MoE experts' grouped GEMM against the per-expert loop, bf16;
- bench_moe_block: qwen3_30b_a3b's MoE block at 1 and 4 sequences a micro-batch: GPU time, the host's time to
  issue it and the planner's time for it (where the published MoE runs plan too fast, docs/planning.md).
NCCL refuses two ranks on one GPU, so every check is one process. Exit code: 0 when every check passed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarize(junit: Path) -> list[tuple[str, str, float, str]]:
    """(test id, outcome, seconds, first line of the reason) per test case of a junit XML report."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                text = (node.get("message") or node.text or "").strip()
                reason = text.splitlines()[0][:100] if text else ""
                break
        rows.append((name, outcome, float(case.get("time", 0.0)), reason))
    return rows


def run_tests(pytest_args: list[str]) -> list[tuple[str, str, float, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                str(ROOT / "tests/gpu"),
                f"--junitxml={junit}",
                *pytest_args,
            ],
            cwd=ROOT,
        )
        return (
            summarize(junit) if junit.is_file() else [("tests/gpu", "ERROR", 0.0, "pytest wrote no report")]
        )


def benches(dry: bool) -> list[tuple[str, list[str], str]]:
    """(name, command, the line of its output to report) per speed check; --dry: CPU and tiny sizes."""
    py = [sys.executable]
    if dry:
        vs_hf = [
            "--device",
            "cpu",
            "--fp8",
            "--seq",
            "32",
            "--batch",
            "1",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
        ]
        experts = [
            "--device",
            "cpu",
            "--experts",
            "4",
            "--rows",
            "64",
            "--hidden",
            "32",
            "--ffn",
            "32",
            "--repeats",
            "1",
        ]
    else:
        vs_hf = [
            "--device",
            "cuda",
            "--preset",
            "1b",
            "--layers",
            "8",
            "--fp8",
            "--compile",
            "--repeats",
            "3",
            "--steps",
            "3",
            "--warmup",
            "2",
        ]
        experts = [
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--experts",
            "8",
            "--rows",
            "32768",
            "--hidden",
            "2048",
            "--ffn",
            "1024",
            "--repeats",
            "5",
        ]
    gpu = ["--dry"] if dry else []
    # the targets: llama_1b shape, 8 layers, 8 micro-batches: MFU >= 0.40, >= 1.0x compiled transformers and
    # torchtitan; 16 layers: fp8 >= 1.15x bf16
    short = ["--repeats", "2", "--steps", "2", "--warmup", "2"]
    peers = py + [
        str(ROOT / "benchmarks/bench_gpu.py"),
        "--layers",
        "8",
        "--micro-batches",
        "8",
        *short,
        *gpu,
    ]
    fp8 = py + [
        str(ROOT / "benchmarks/bench_gpu.py"),
        "--layers",
        "16",
        "--micro-batches",
        "8",
        "--fp8",
        "--sides",
        "megaframe",
        *short,
        *gpu,
    ]
    return [
        (
            "bench_gpu A (8 layers, 8 micro-batches: megaframe vs compiled transformers, torchtitan)",
            peers,
            r"MFU [0-9]|SKIP|ratio",
        ),
        ("bench_gpu B (16 layers: fp8 vs bf16)", fp8, r"MFU [0-9]|ratio"),
        (
            "bench_vs_hf (bf16, fp8, transformers)",
            py + [str(ROOT / "benchmarks/bench_vs_hf.py"), *vs_hf],
            r"ratio .*wall",
        ),
        (
            "bench_experts (grouped vs loop)",
            py + [str(ROOT / "benchmarks/bench_experts.py"), *experts],
            r"ratio|median",
        ),
        (
            "bench_moe_block (an MoE block at 1 and 4 sequences: gpu vs host vs planned)",
            py + [str(ROOT / "benchmarks/bench_moe_block.py"), *(["--dry", "--repeats", "1"] if dry else [])],
            r"tokens: gpu",
        ),
    ]


def run_bench(name: str, cmd: list[str], pattern: str, timeout: float) -> tuple[str, str, float, str]:
    t = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return name, "FAILED", time.perf_counter() - t, f"timed out after {timeout:.0f}s"
    took = time.perf_counter() - t
    print(res.stdout, flush=True)
    if res.returncode != 0:
        return name, "FAILED", took, (res.stderr.strip().splitlines() or ["no output"])[-1][:200]
    lines = [ln.strip() for ln in res.stdout.splitlines() if re.search(pattern, ln)]
    return name, "passed", took, " | ".join(lines)


TARGETS = [  # (what, regex over the bench lines, at least): issue "fast where users run it", one H100
    (
        "A megaframe MFU (8 layers, 8 micro-batches, bf16 compiled)",
        r"megaframe +tokens/s .*? MFU ([0-9.]+)",
        0.40,
    ),
    ("A megaframe / compiled transformers", r"ratio megaframe / hf_llama: ([0-9.]+)", 1.0),
    ("A megaframe / compiled torchtitan", r"ratio megaframe / torchtitan: ([0-9.]+)", 1.0),
    ("B fp8 / bf16 (16 layers)", r"ratio megaframe_fp8 / megaframe: ([0-9.]+)", 1.15),
]


def targets(rows, judge: bool) -> None:
    """One line per speed target with the measured figure
    (MISS or PASS on a GPU; --dry only shows the parsing)."""
    text = " | ".join(r[3] for r in rows if r[0].startswith("bench_gpu"))
    print("\nspeed targets:")
    for what, pattern, least in TARGETS:
        m = re.search(pattern, text)
        got = float(m.group(1)) if m else None
        verdict = (
            "not measured" if got is None else ("PASS" if got >= least else "MISS") if judge else "(dry)"
        )
        print(f"  {verdict:<12} {what}: {'-' if got is None else f'{got:.3f}'} (target >= {least})")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU and tiny sizes (the harness only)")
    ap.add_argument("--only", choices=["tests", "benches"], default=None)
    ap.add_argument("--bench-timeout", type=float, default=300.0, help="seconds per bench")
    args, pytest_args = ap.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    import torch

    cuda = torch.cuda.is_available() and not args.dry
    device = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)" if args.dry else "no CUDA device"
    rows = run_tests(pytest_args) if args.only != "benches" else []
    if args.only != "tests" and (cuda or args.dry):
        rows += [run_bench(n, c, p, args.bench_timeout) for n, c, p in benches(args.dry)]
    if args.only != "tests" and (cuda or args.dry):
        targets(rows, judge=cuda)
    print(f"\nGPU checks on {device}:")
    for name, outcome, seconds, reason in rows:
        print(f"  {outcome:<8} {seconds:7.1f}s  {name}" + (f"  ({reason})" if reason else ""))
    counts = {o: sum(r[1] == o for r in rows) for o in ("passed", "FAILED", "ERROR", "skipped")}
    print(
        "summary: "
        + ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n)
        + ("" if cuda else " (no CUDA: tests/gpu skipped)")
    )
    return 1 if counts["FAILED"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
