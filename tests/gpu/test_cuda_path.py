"""CUDA path (runs where a GPU exists): the same tiny run on cuda matches the CPU run."""

import pytest
import torch

from tests.e2e.helpers import TINY, metrics, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_run_matches_cpu(tmp_path):
    over = ["data=synthetic", *TINY, "train.max_steps=4", "train.log_interval=1"]
    for dev in ("cpu", "cuda"):
        res = train(over + [f"train.device={dev}", f"run.dir={tmp_path / dev}"])
        assert res.returncode == 0, res.stderr[-2000:]
    cpu, gpu = metrics(tmp_path / "cpu"), metrics(tmp_path / "cuda")
    for a, b in zip(gpu, cpu):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-3
    assert gpu[-1]["mem/peak_bytes"] > 0
