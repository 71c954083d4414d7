"""MoE end to end: torchrun with 4 expert-parallel ranks equals one process; load_model reads the
ep-sharded checkpoint; a bad expert layout exits 2 with one line."""

import pytest
import torch

from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e

MOE = [
    "model=moe_tiny",
    "data=synthetic",
    *TINY,
    "model.moe_ffn_hidden_size=64",
    # 3 steps: routing, aux losses and expert grads of steps 2-3 follow the ep4 optimizer's updates
    "train.max_steps=3",
    "train.log_interval=1",
]


def test_torchrun_ep4_matches_one_process_and_loads(tmp_path):
    import megaframe

    one = train(MOE + [f"run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    four = train(MOE + ["parallel.ep=4", f"run.dir={tmp_path / 'ep4'}"], nproc=4)
    assert four.returncode == 0, four.stderr[-3000:]
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "ep4")
    assert [r["step"] for r in got] == list(range(1, 4))
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) / b["loss"] <= 1e-4, (a["loss"], b["loss"])
        assert abs(a["aux_loss"] - b["aux_loss"]) / b["aux_loss"] <= 1e-4, (a["aux_loss"], b["aux_loss"])
        assert a["moe/layer1/tokens_max"] == b["moe/layer1/tokens_max"]
    assert got[0]["comm_bytes/ep"] > 0 and ref[0]["comm_bytes/ep"] == 0
    assert {"z_loss", "moe/layer0/tokens_cv", "moe/layer0/dropped_frac", "moe/layer0/router_entropy"} <= set(
        got[0]
    )
    # each rank holds 2 of the 8 experts (2 layers x 8 experts x [gate|up|down] 3 x D 64 x F 64, fp32)
    expert_bytes = 2 * 8 * 3 * 64 * 64 * 4
    assert ref[0]["mem/params_bytes"] - got[0]["mem/params_bytes"] == expert_bytes * 3 // 4
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = megaframe.load_model(str(tmp_path / "ep4" / "checkpoints"))(ids)
        b = megaframe.load_model(str(tmp_path / "one" / "checkpoints"))(ids)
    assert a.shape == (2, 32, 4096)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_expert_layout_that_cannot_work_exits_2(tmp_path):
    res = train(["model=moe_tiny", "data=synthetic", "parallel.ep=3", f"run.dir={tmp_path}/r"], timeout=60)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "parallel.ep=3" in lines[0], res.stderr
