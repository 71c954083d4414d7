"""The fast path on CUDA (runs where a GPU exists): no device sync inside a step, bf16 with compile and
recompute trains, and bench_vs_hf's GPU goal runs."""
import subprocess
import sys

import pytest
import torch

from megaframe.config import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _steps(overrides: list[str], n: int):
    from megaframe.data.dataset import build_data, microbatches
    from megaframe.model.gpt import build_model
    from megaframe.optim.build import build_optimizer, cast_model
    from megaframe.parallel.mesh import single_process_mesh
    from megaframe.training.step import train_step
    from tests.distributed.cases import tiny_config

    cfg = tiny_config(["train.device=cuda", *overrides], 1)
    mesh = single_process_mesh("cuda")
    model = cast_model(build_model(cfg, mesh), cfg.train.precision)
    opt = build_optimizer(model, cfg.optim, mesh)
    t = cfg.train
    batches = [microbatches(build_data(cfg), s, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed, mesh.device)
               for s in range(n)]
    train_step(model, opt, batches[0], mesh, cfg, 1)  # warm-up: lazy state, compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit device sync now raises
    try:
        results = [train_step(model, opt, b, mesh, cfg, s + 2) for s, b in enumerate(batches[1:])]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [r.loss_sum.item() for r in results]


@pytest.mark.parametrize("over", [[], ["train.precision=bf16", "train.recompute=selective"],
                                  ["train.precision=bf16", "train.compile=true", "train.recompute=full"]])
def test_cuda_steps_do_not_sync(over):
    losses = _steps(over, 3)
    assert all(x == x for x in losses)


def test_bench_vs_hf_cuda_runs():
    res = subprocess.run([sys.executable, str(ROOT / "scripts/bench_vs_hf.py"), "--device", "cuda", "--repeats", "1",
                          "--steps", "1", "--warmup", "1", "--batch", "1", "--seq", "512"],
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ratio megaframe / hf_llama" in res.stdout and "MFU" in res.stdout
