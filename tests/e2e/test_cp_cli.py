"""Context parallelism through the training command: torchrun cp2 (with eval) against one process."""

import pytest

from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e


def test_torchrun_cp2_matches_one_process_with_val_loss(tmp_path):
    over = [
        "data=synthetic",
        *TINY,
        "train.max_steps=4",
        "train.log_interval=1",
        "train.eval_interval=2",
        "train.eval_iters=1",
    ]
    one = train(over + [f"run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = train(over + ["parallel.cp=2", f"run.dir={tmp_path / 'cp2'}"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "cp2")
    assert [r["step"] for r in got] == list(range(1, 5))
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
        if "val_loss" in b:
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * abs(b["val_loss"]), (a, b)
    assert any("val_loss" in r for r in got)
    assert got[0]["comm_bytes/cp"] > 0 and ref[0]["comm_bytes/cp"] == 0


def test_torchrun_moe_cp2_ep2_matches_one_process(tmp_path):
    """MoE under cp through the command: cp2·ep2 (ep borrowed from cp) logs the one-process loss,
    val_loss (eval routes under no_grad, capacity counted over cp) and router figures."""
    over = [
        "data=synthetic",
        *TINY,
        "model=moe_tiny",
        "model.moe_capacity_factor=1.0",
        "train.max_steps=3",
        "train.log_interval=1",
        "train.eval_interval=3",
        "train.eval_iters=1",
    ]
    one = train(over + [f"run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = train(over + ["parallel.cp=2", "parallel.ep=2", f"run.dir={tmp_path / 'cp2ep2'}"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "cp2ep2")
    assert [r["step"] for r in got] == list(range(1, 4)) and any("val_loss" in r for r in got)
    for a, b in zip(got, ref):
        for key in (
            "loss",
            "val_loss",
            "aux_loss",
            "z_loss",
            "moe/layer0/tokens_max",
            "moe/layer1/dropped_frac",
        ):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (key, a[key], b[key])
    assert got[0]["comm_bytes/ep"] > 0 and got[0]["comm_bytes/cp"] > 0
