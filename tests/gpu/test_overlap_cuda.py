"""The overlapped kinds on CUDA (runs where a GPU exists): a forward on the side stream of its worker thread
beside a backward on the default one, the lane set on autograd's device thread by the chunk's mark, gives
the plain 1f1b's losses (same work per thread in the same order; one process, so the lanes' collectives
are of size 1: what this holds is the streams and threads, which the CPU suite cannot)."""

import pytest
import torch

from tests.e2e.helpers import metrics, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_overlap_on_cuda_gives_1f1bs_losses(tmp_path):
    over = [
        "data=synthetic",
        "model=moe_tiny",
        "train.device=cuda",
        "train.global_batch_size=16",
        "train.max_steps=4",
        "optim.warmup_steps=1",
        "train.log_interval=1",
    ]
    for kind in ("1f1b", "1f1b_overlap"):
        res = train(over + [f"parallel.pp_schedule={kind}", f"run.dir={tmp_path / kind}"])
        assert res.returncode == 0, res.stderr[-2000:]
    plain, overlapped = metrics(tmp_path / "1f1b"), metrics(tmp_path / "1f1b_overlap")
    # not bit for bit: CUDA's atomic adds (the experts' row scatters) sum in any order, run to run
    assert [m["loss"] for m in overlapped] == pytest.approx([m["loss"] for m in plain], rel=1e-4)
