"""ZeRO through the real entry points: torchrun dp=2 logs the dp bytes and memory the theory predicts;
zero=3 logs sharded params and resumes from its own checkpoint."""

import math
import re

import pytest

from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e


def test_dp2_zero_figures_match_theory(tmp_path):
    over = ["data=synthetic", *TINY, "train.max_steps=3", "train.log_interval=1"]
    # ranks started as srun does: the logged figures are the subject (torchrun: the ZeRO-3 test below)
    res = train(over + [f"run.dir={tmp_path / 'z'}"], nproc=2, launcher="env")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "z")
    assert [r["step"] for r in rows] == [1, 2, 3]
    n = rows[0]["mem/params_bytes"] // 4  # fp32 params on this rank
    b = math.ceil(n / 2) * 2  # one bucket (default 25 MiB), padded to a multiple of dp
    # reduce-scatter + all-gather of the fp32 buffer, (dp-1)/dp of it each, plus the grad-norm scalar
    theory = 2 * (1 / 2) * 4 * b + 2 * (1 / 2) * 4
    for r in rows:
        assert abs(r["comm_bytes/dp"] - theory) <= 3, (r, theory)
        assert r["mem/grads_bytes"] == 4 * b and r["mem/optim_bytes"] == 8 * b // 2
        assert math.isfinite(r["loss"])


def test_train_bf16_loss_falls_and_checkpoint_keeps_master(tmp_path):
    from megaframe.checkpoint import sharded

    over = ["data=synthetic", *TINY, "train.max_steps=8", "train.log_interval=1", "train.precision=bf16"]
    res = train(over + [f"run.dir={tmp_path / 'b'}"])
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [r["loss"] for r in metrics(tmp_path / "b")]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    meta = sharded.read_metadata(tmp_path / "b" / "checkpoints" / "step_00000008")
    assert meta["tensors"]["model/layers.0.mlp.up_proj.weight"]["dtype"] == "bfloat16"
    assert meta["tensors"]["optim/master/layers.0.mlp.up_proj.weight"]["dtype"] == "float32"


def test_torchrun_zero3_logs_sharded_memory_and_resumes(tmp_path):
    """The trainer at dp2 with optim.zero=3: mem/params_bytes below the whole model's, the gathered peak
    logged, and a run resumed from its step-2 checkpoint (saved from sharded params) continues the losses
    of the uninterrupted one."""
    model = [*TINY, "model.vocab_size=256"]
    over = [
        "data=synthetic",
        *model,
        "train.max_steps=4",
        "train.log_interval=1",
        "optim.zero=3",
        "checkpoint.interval=2",
    ]
    full = train(over + [f"run.dir={tmp_path / 'full'}"], nproc=2)
    assert full.returncode == 0, full.stderr[-3000:]
    # the header's per-rank share is the ZeRO-3 shard (before: the whole model, as if nothing were sharded)
    total, mine = map(
        float, re.search(r"params ([\d.]+)M, ([\d.]+)M on this rank \(ZeRO-3 shard\)", full.stdout).groups()
    )
    assert 0.4 * total <= mine <= 0.6 * total, full.stdout[:1500]
    rows = metrics(tmp_path / "full")
    # dp=2: grads are 1/2 of the fp32 buffer, so 2x grads is the whole model's fp32 params
    assert all(
        r["mem/params_bytes"] < 2 * r["mem/grads_bytes"] and r["mem/gathered_peak_bytes"] > 0 for r in rows
    ), rows
    resumed = train(
        over
        + [
            f"run.dir={tmp_path / 'res'}",
            "train.max_steps=4",
            f"checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step_00000002'}",
        ],
        nproc=2,
        launcher="env",  # ranks started as srun does: the resume is the subject (torchrun: the run above)
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in metrics(tmp_path / "res")}
    for r in rows[2:]:
        assert abs(got[r["step"]] - r["loss"]) <= 1e-5 * abs(r["loss"]), (got, rows)
