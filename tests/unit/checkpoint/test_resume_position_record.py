"""A checkpoint's sample position (consumed_samples, consumed_tokens, the data cursor) decides which samples a
resumed run reads next: edited by hand, the run would silently skip or repeat data. The save seals those
fields (a sha256 of each in metadata.json, like the step its folder holds); a resume refuses an edited one
with one line naming the field and the file, before any weight is loaded."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megaframe.checkpoint import sharded
from megaframe.checkpoint.resume import resume
from megaframe.config import ConfigError, load_config
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build

TINY = ["data=synthetic", "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64"]
TINY += ["model.num_attention_heads=4", "model.vocab_size=128", "model.seq_length=16"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A committed step_00000002 of a tiny run that consumed 16 samples; (path, cfg, mesh)."""
    cfg = load_config(["model=gpt_tiny", *TINY], world_size=1)
    mesh = single_process_mesh()
    meta = {
        "config": dataclasses.asdict(cfg),
        "consumed_samples": 16,
        "consumed_tokens": 256,
        "data": {"kind": "synthetic", "consumed_samples": 16},
    }
    root = tmp_path_factory.mktemp("position")
    path = sharded.save(root, 2, *build(cfg, mesh), mesh, meta)
    return path, cfg, mesh


def _resume(path, cfg, mesh):
    run = load_config(["model=gpt_tiny", *TINY, f"checkpoint.resume={path}"], world_size=1)
    return resume(run, *build(cfg, mesh), mesh)


def test_an_untouched_checkpoint_resumes_at_its_recorded_position(saved):
    path, cfg, mesh = saved
    assert _resume(path, cfg, mesh).consumed == 16


EDITS = {
    "consumed_samples": lambda m: m.update(consumed_samples=999),
    "consumed_tokens": lambda m: m.update(consumed_tokens=1),
    "data": lambda m: m["data"].update(consumed_samples=0),
}


def test_a_hand_edited_position_is_refused_naming_the_field_and_the_file(saved, tmp_path):
    path, cfg, mesh = saved
    for field, edit in EDITS.items():
        root = tmp_path / field
        copy = root / path.name
        copy.mkdir(parents=True)
        for f in path.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        (root / "latest").write_text(path.name + "\n")
        meta = json.loads((copy / "metadata.json").read_text())
        edit(meta)
        (copy / "metadata.json").write_text(json.dumps(meta, indent=1))
        # named explicitly, and found by resume=auto (refused there too, not skipped for an older one)
        for resume_as in (None, "auto"):
            with pytest.raises(ConfigError) as info:
                run = ["model=gpt_tiny", *TINY, f"checkpoint.resume={resume_as or copy}"]
                run += [f"checkpoint.dir={root}"]
                resume(load_config(run, world_size=1), None, None, mesh)
            text = str(info.value)
            assert f"{copy / 'metadata.json'}: {field} " in text and "\n" not in text, text
        # the offline verification (python -m megaframe.checkpoint verify) says the same
        with pytest.raises(sharded.CheckpointError, match=f"metadata.json: {field} "):
            sharded.verify(copy)
    sharded.verify(path)  # the untouched one verifies
