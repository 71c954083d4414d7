"""A resume at or past train.max_steps trains nothing and says so in one warning, instead of `steps 9..3`
and an lr warning about a decay no step will follow; the checkpoint is left as it was."""
from __future__ import annotations

import pytest

from tests.e2e.helpers import TINY, train

pytestmark = pytest.mark.e2e


def test_a_resume_past_max_steps_says_nothing_is_trained(tmp_path):
    over = ["data=synthetic", *TINY, "train.log_interval=1", f"run.dir={tmp_path}"]
    first = train(over + ["train.max_steps=3", "checkpoint.interval=3"])
    assert first.returncode == 0, first.stderr[-2000:]
    shard = next((tmp_path / "checkpoints" / "step_00000003").glob("*.safetensors")).read_bytes()
    again = train(over + ["train.max_steps=2"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "nothing to train: the run resumed at step 3, at or past train.max_steps=2" in again.stderr
    assert "before the decay reaches" not in again.stderr and "steps 4..2" not in again.stdout, again.stderr
    assert next((tmp_path / "checkpoints" / "step_00000003").glob("*.safetensors")).read_bytes() == shard
