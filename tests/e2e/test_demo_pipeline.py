"""The make-train path on the real demo corpus: prepare (sentencepiece + shards), train, log, checkpoint."""

import json
import math
import sys

import pytest

from tests.e2e.helpers import metrics, run, train

pytestmark = pytest.mark.e2e

KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "consumed_samples",
    "mfu",
    "comm_bytes/tp",
    "comm_bytes/dp",
    "comm_bytes/pp",
    "mem/params_bytes",
    "mem/grads_bytes",
    "mem/optim_bytes",
}


def test_prepare_then_train_on_demo_corpus(tmp_path):
    data = tmp_path / "prepared"
    prep = run([sys.executable, "-m", "megaframe.data.prepare", f"data.path={data}", "data.vocab_size=2048"])
    assert prep.returncode == 0, prep.stderr[-2000:]
    meta = json.loads((data / "meta.json").read_text())
    assert meta["num_tokens"] > 1_000_000 and (data / "tokenizer.model").is_file()
    over = [
        f"data.path={data}",
        "model.vocab_size=2048",
        "model.num_layers=2",
        "model.hidden_size=96",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=256",
        "model.seq_length=64",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "train.max_steps=60",
        "train.log_interval=1",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        f"run.dir={tmp_path / 'run'}",
        "run.name=demo-test",
        "logging.wandb.mode=offline",
    ]
    res = train(over, WANDB_MODE="offline")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert KEYS <= rows[0].keys()
    first, last5 = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert abs(first - math.log(2048)) < 0.3  # starts at chance level
    assert last5 < first - 1.2, [round(r["loss"], 3) for r in rows]
    assert rows[-1]["consumed_samples"] == 60 * 16
    assert "step     60/60 | loss" in res.stdout  # the readable console line
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000060"
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")), "wandb offline run missing"
