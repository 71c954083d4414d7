"""benchmarks/bench_gpu.py, the fair one-GPU comparison,
runs its harness on CPU (--dry) and reports every peer."""

import re
import subprocess
import sys

from megaframe.config import ROOT


def test_bench_gpu_dry_reports_megaframe_transformers_and_torchtitan():
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--dry"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "2 micro-batches x 1 x 32 tokens per step" in out and "(6 N_matmul + 12 L S H E)" in out
    figure = (
        r"tokens/s +[0-9.]+ \| MFU [0-9.]+ \| peak .* GiB \| per step [0-9.]+ ms "
        r"\+ per micro-batch [0-9.]+ ms"
    )
    for side in ("megaframe", "hf_llama"):
        assert re.search(rf"{side} +{figure}", out), out
    # torchtitan needs triton (CUDA torch): on a CPU-only torch it says why it is left out
    assert re.search(rf"torchtitan +({figure}|SKIP: not importable)", out), out
    assert re.search(r"ratio megaframe / hf_llama: [0-9.]+", out), out
