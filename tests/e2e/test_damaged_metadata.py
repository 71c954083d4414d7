"""A checkpoint whose metadata.json has a damaged field (a tensor's dtype, its pieces): resume=auto passes it
over to the parent with a warning, like any other damage; verify, an explicit resume and the HF export exit 2
with one line naming the file, the tensor and the field."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY, run, train

pytestmark = pytest.mark.e2e

OVER = ["data=synthetic", *TINY, "train.log_interval=1", "checkpoint.interval=1"]
KEY = "model/embed.weight"
_BASE: dict = {}


def base(tmp_path_factory) -> Path:
    """A run folder with committed steps 1 and 2 (made once, copied by each test)."""
    if not _BASE:
        d = tmp_path_factory.mktemp("base")
        res = train(OVER + ["train.max_steps=2", f"run.dir={d}"])
        assert res.returncode == 0, res.stderr[-2000:]
        _BASE["dir"] = d
    return _BASE["dir"]


def damaged(tmp_path, tmp_path_factory, field: str, value) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(base(tmp_path_factory), run_dir)
    path = run_dir / "checkpoints" / "step_00000002" / "metadata.json"
    meta = json.loads(path.read_text())
    entry = meta["tensors"][KEY]
    (entry["shards"][0] if field == "pieces" else entry)[field] = value
    path.write_text(json.dumps(meta))
    return run_dir


def one_line(res, *words: str) -> None:
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if "megaframe: error:" in ln]
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.stderr[-2000:]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("dtype", "complex999", ["dtype 'complex999'"]),
        ("pieces", [[[0, 4096]]], ["pieces"]),
    ],
    ids=["dtype", "pieces"],
)
def test_resume_auto_skips_a_damaged_field_to_the_parent(tmp_path, tmp_path_factory, field, value, words):
    run_dir = damaged(tmp_path, tmp_path_factory, field, value)
    res = train(OVER + ["train.max_steps=3", f"run.dir={run_dir}", "checkpoint.interval=0"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step_00000001" in res.stdout and "resumed from" in res.stdout, res.stdout[-2000:]
    warning = [ln for ln in res.stderr.splitlines() if "step_00000002" in ln and "warning" in ln]
    assert warning and "metadata.json" in warning[0] and KEY in warning[0] and words[0] in warning[0], (
        res.stderr
    )
    assert "not enough values" not in res.stderr


@pytest.mark.parametrize(
    "field,value", [("dtype", "complex999"), ("pieces", [[[0, 4096]]])], ids=["dtype", "pieces"]
)
def test_verify_export_and_explicit_resume_name_file_tensor_and_field(
    tmp_path, tmp_path_factory, field, value
):
    step = damaged(tmp_path, tmp_path_factory, field, value) / "checkpoints" / "step_00000002"
    words = ["metadata.json", KEY, field]
    one_line(run([sys.executable, "-m", "megaframe.checkpoint", "verify", str(step)]), *words)
    one_line(run([sys.executable, "scripts/export_hf.py", str(step), str(tmp_path / "hf")]), *words)
    one_line(
        train(OVER + ["train.max_steps=3", f"run.dir={tmp_path / 'other'}", f"checkpoint.resume={step}"]),
        *words,
    )
    assert not (tmp_path / "hf").exists()
