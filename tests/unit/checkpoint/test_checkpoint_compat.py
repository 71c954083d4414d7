"""A checkpoint written by an earlier version of megaframe still loads: tests/fixtures/ckpt_v2_tiny was
written by commit 1276b81 (before the package's files moved to runops/, checkpoint/resume.py, ...) with

    python train.py data=synthetic model.num_layers=2 model.hidden_size=32 model.num_attention_heads=4 \
        model.num_query_groups=2 model.ffn_hidden_size=64 model.seq_length=16 model.vocab_size=128 \
        train.global_batch_size=4 train.micro_batch_size=2 train.max_steps=2 checkpoint.interval=2

and expected_logits.safetensors holds that version's load_model logits for fixed ids. Nothing in a
checkpoint may name a Python module or file of the package (safetensors and JSON only), so moves and
renames inside the package never break one. tests/fixtures/ckpt_d287bc3_tiny is the same run written by
commit d287bc3 (before the data kinds were registered, load_model's body and the typed builder moved)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import run

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_v2_tiny"
BEFORE_SEAMS = ROOT / "tests" / "fixtures" / "ckpt_d287bc3_tiny"
MODEL = [
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    "model.seq_length=16",
    "model.vocab_size=128",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "logging.wandb.mode=disabled",
]


@pytest.mark.parametrize("fixture", [FIXTURE, BEFORE_SEAMS], ids=["v2", "d287bc3"])
def test_an_earlier_versions_checkpoint_gives_its_logits(fixture):
    import megaframe

    want = load_file(str(fixture / "expected_logits.safetensors"))
    with torch.no_grad():
        got = megaframe.load_model(str(fixture))(want["ids"])
    torch.testing.assert_close(got, want["logits"], rtol=1e-5, atol=1e-6)


def test_the_data_record_of_a_checkpoint_before_the_data_kinds_compares_equal():
    """A resume of the d287bc3 checkpoint with the run's own settings sees no change of data."""
    from megaframe.checkpoint.sharded import read_metadata
    from megaframe.config import load_config
    from megaframe.data.kinds import data_changes, data_state

    meta = read_metadata(BEFORE_SEAMS / "step_00000002")
    cfg = load_config(MODEL, world_size=1)
    assert data_changes(cfg.data, meta) == []
    # what this code records for the same run is what that code recorded
    state = data_state(cfg.data, 2, cfg.train.seed, cfg.train.global_batch_size)
    assert {k: v for k, v in state.items() if k != "kind"} == {
        k: v for k, v in meta["data"].items() if k != "kind"
    }


def test_an_earlier_versions_checkpoint_verifies_and_resumes(tmp_path):
    ck = tmp_path / "checkpoints"
    shutil.copytree(FIXTURE, ck)  # the run writes beside what it resumes: never into the fixture
    # forks of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the old checkpoint
    verify = run(
        [sys.executable, "-m", "megaframe.checkpoint", "verify", str(ck / "step_00000002")], timeout=120
    )
    assert verify.returncode == 0, verify.stderr
    res = run(
        [
            sys.executable,
            "train.py",
            *MODEL,
            "train.max_steps=3",
            "train.log_interval=1",
            f"run.dir={tmp_path / 'run'}",
            f"checkpoint.dir={ck}",
            "checkpoint.interval=0",
            f"checkpoint.resume={ck / 'step_00000002'}",
        ],
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3] and math.isfinite(rows[0]["loss"])
