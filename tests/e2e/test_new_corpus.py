"""A corpus never seen before (the Python stdlib's docstrings, see stdlib_corpus.py), prepared with the
CLI on every core and trained on for 40 steps with a validation split; and bad data refused by the
commands a user runs, with exit 2, one line, and the prepared data untouched."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time

import pytest

from tests.e2e.helpers import metrics, run, train
from tests.e2e.stdlib_corpus import write_corpus

pytestmark = pytest.mark.e2e
VOCAB = 512


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    src = write_corpus(root / "corpus")
    out = root / "prepared"
    res = run(
        [
            sys.executable,
            "-m",
            "megaframe.data.prepare",
            f"data.source={src}",
            f"data.path={out}",
            f"data.vocab_size={VOCAB}",
            "data.num_workers=2",
        ],
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tokens/s" in res.stdout
    return out


def test_prepared_stdlib_corpus(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    # data.split=file (the default): one document per source file
    assert (
        meta["num_tokens"] > 500_000
        and meta["num_documents"] == len(meta["sources"])
        and meta["vocab_size"] == VOCAB
    )
    assert len(meta["sources"]) > 100 and all(len(s["sha256"]) == 64 for s in meta["sources"])
    assert len(meta["shards"]) >= 2  # chunks went to both workers


def test_train_40_steps_loss_falls_more_than_one_nat(prepared, tmp_path):
    over = [
        f"data.path={prepared}",
        "data.name=stdlib",
        f"model.vocab_size={VOCAB}",
        "model.num_layers=2",
        "model.hidden_size=96",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=256",
        "model.seq_length=64",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        "train.max_steps=40",
        "train.log_interval=1",
        "optim.lr=5e-3",
        "optim.warmup_steps=5",
        "data.valid_fraction=0.05",
        "train.eval_interval=20",
        "train.eval_iters=2",
        f"run.dir={tmp_path / 'run'}",
        "run.name=stdlib-test",
    ]
    res = train(over, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 41))
    first, last5 = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert abs(first - math.log(VOCAB)) < 0.3
    assert last5 < first - 1.0, [round(r["loss"], 3) for r in rows]
    vals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(vals) == [20, 40] and vals[40] < vals[20] < first - 0.5
    assert "| val " in res.stdout
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000040" / "metadata.json").read_text())
    data = meta["data"]
    assert data["consumed_samples"] == 640 and data["valid_fraction"] == 0.05 and "derived" in data["cursor"]


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("truncate", "truncated"),
        ("tokenizer", "does not match the tokenizer"),
        ("vocab", "model.vocab_size=256"),
    ],
)
def test_train_refuses_bad_prepared_data(prepared, tmp_path, damage, needle):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    if damage == "truncate":
        shard = sorted(data.glob("shard_*.bin"))[-1]
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "tokenizer":
        (data / "tokenizer.model").write_bytes((data / "tokenizer.model").read_bytes()[:-1] + b"\1")
    before = snapshot(data)
    t0 = time.time()
    vocab = 256 if damage == "vocab" else VOCAB
    res = train([f"data.path={data}", f"model.vocab_size={vocab}", f"run.dir={tmp_path / 'r'}"], timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megaframe: error: ") and needle in lines[0], lines
    assert time.time() - t0 < 30 and snapshot(data) == before and not (tmp_path / "r").exists()


def test_prepare_refuses_binary_garbage_and_keeps_good_data(prepared, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("Fine text.\n\nMore fine text.\n")
    (src / "photo.txt").write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    before = snapshot(out)
    res = run(
        [sys.executable, "-m", "megaframe.data.prepare", f"data.source={src}", f"data.path={out}"], timeout=60
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "photo.txt: binary data" in lines[0], res.stderr
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_val_loss_is_layout_free_and_leaves_comm_bytes_alone(prepared, tmp_path):
    """val_loss under pp=2 (a forward-only schedule through the executor) equals one process's; evaluation
    traffic is not counted in the step's comm_bytes."""
    over = [
        f"data.path={prepared}",
        f"model.vocab_size={VOCAB}",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.ffn_hidden_size=128",
        "model.seq_length=32",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.max_steps=2",
        "train.log_interval=1",
        "data.valid_fraction=0.05",
        "train.eval_interval=2",
        "train.eval_iters=2",
    ]
    one = train(over + [f"run.dir={tmp_path / 'one'}"], timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    # ranks started as srun does: the validation loss is the subject, not the launcher
    pp2 = train(over + ["parallel.pp=2", f"run.dir={tmp_path / 'pp2'}"], nproc=2, timeout=180, launcher="env")
    assert pp2.returncode == 0, pp2.stderr[-3000:]
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "pp2")
    assert (
        "val_loss" not in got[0] and abs(got[1]["val_loss"] - ref[1]["val_loss"]) <= 1e-4 * ref[1]["val_loss"]
    )
    assert got[0]["comm_bytes/pp"] == got[1]["comm_bytes/pp"] > 0  # step 2 evaluated, step 1 did not


def test_data_stages_resume_inside_a_stage_continues_identically(prepared, tmp_path):
    """data.stages with two boundaries (steps 2 and 4) over two datasets: metrics show the stage, and a run
    resumed from step 3 (inside stage 2) gives the uninterrupted run's losses."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(prepared, a)
    shutil.copytree(prepared, b)
    stages = (
        f"[{{until_step: 2, blend: [{{path: {a}, weight: 1}}]}}, "
        f"{{until_step: 4, blend: [{{path: {a}, weight: 0.5}}, "
        f"{{path: {b}, weight: 0.5}}]}}, {{blend: [{{path: {b}, weight: 1}}]}}]"
    )
    over = [
        f"data.stages={stages}",
        "data.name=stdlib",
        f"model.vocab_size={VOCAB}",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.num_query_groups=1",
        "model.ffn_hidden_size=64",
        "model.seq_length=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.log_interval=1",
    ]
    full = train(over + ["checkpoint.interval=3", f"run.dir={tmp_path / 'full'}"], timeout=120)
    assert full.returncode == 0, full.stderr[-3000:]
    rows = metrics(tmp_path / "full")
    assert [r["data/stage"] for r in rows] == [0, 0, 1, 1, 2, 2]
    step3 = tmp_path / "full" / "checkpoints" / "step_00000003"
    assert len(json.loads((step3 / "metadata.json").read_text())["data"]["stages"]) == 3
    resumed = train(over + [f"checkpoint.resume={step3}", f"run.dir={tmp_path / 'resumed'}"], timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = metrics(tmp_path / "resumed")
    assert [r["step"] for r in again] == [4, 5, 6]
    for x, y in zip(rows[3:], again):
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"]), (x["loss"], y["loss"])
