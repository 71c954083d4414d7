"""A real resume of a blend run with other weights is refused (exit 2, one line naming data.blend), before any
step: the weights re-map every position of the stream, so samples would repeat and others be skipped. The
other data changes and the allowed path are checked in process (tests/unit/data/test_run_record.py)."""

from __future__ import annotations

import json
import shutil

from tests.e2e.helpers import TINY, train


def test_resuming_a_blend_with_other_weights_is_refused(demo_prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(demo_prepared, copy)
    run = ["train.max_steps=2", f"run.dir={tmp_path / 'run'}", *TINY]
    halves = f"data.blend=[{{path: {demo_prepared}, weight: 0.5}}, {{path: {copy}, weight: 0.5}}]"
    first = train([*run, halves])
    assert first.returncode == 0, first.stderr[-2000:]
    res = train(
        [
            *run,
            "train.max_steps=4",
            f"data.blend=[{{path: {demo_prepared}, weight: 0.9}}, {{path: {copy}, weight: 0.1}}]",
        ]
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "was written with data.blend=" in lines[0], lines[0]
    assert "allow_config_change=[data.blend]" in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints" / "step_00000004").exists()
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "metadata.json").read_text())
    assert [s["path"] for s in meta["data"]["sources"]] == [str(demo_prepared.resolve()), str(copy.resolve())]
    assert meta["data"]["path"] is None and meta["tokenizer"]["sha256"]  # the preset's data.path was not read
