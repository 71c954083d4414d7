"""bench_vs_hf's GPU goal runs (where a GPU exists). The step-level checks (no device sync, bf16 with
compile and recompute, dense and MoE) are in test_gpu_checks.py."""

import subprocess
import sys

import pytest
import torch

from megaframe.config import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bench_vs_hf_cuda_runs():
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_vs_hf.py"),
            "--device",
            "cuda",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--batch",
            "1",
            "--seq",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ratio megaframe / hf_llama" in res.stdout and "MFU" in res.stdout
