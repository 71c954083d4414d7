"""Continued pretraining at another context length: a RoPE model's model.seq_length may change at a resume
(named in the header; once samples were consumed it needs allow_config_change, the data going on at the
same token count), a learned-position model's may not (the message says why), and export keeps the
model's own max_position_embeddings unless --max-position-embeddings says otherwise."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megaframe.checkpoint import sharded
from megaframe.checkpoint.resume_checks import Accounting, check_resume, resume_position
from megaframe.config import ConfigError, load_config
from megaframe.parallel.mesh import single_process_mesh
from megaframe.training.header import context_label
from tests.forms import build_model
from tests.unit.hf_scripts import export_hf, import_hf

TINY = ["data=synthetic", "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64"]
TINY += ["model.num_attention_heads=4", "model.vocab_size=128", "model.seq_length=64"]


LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA32["original_max_position_embeddings"] = 32  # Llama 3.2's rope_scaling, a tiny pretraining context


def save(root, preset: str, **model):
    """A committed step_00000002 of a tiny `preset` model (fields in `model` replaced); (path, cfg)."""
    cfg = load_config([f"model={preset}", *TINY], world_size=1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    mesh = single_process_mesh()
    meta = {"config": dataclasses.asdict(cfg), "consumed_samples": 0}
    path = sharded.save(root, 2, build_model(cfg, mesh), import_hf.WeightsOnly(), mesh, meta)
    return path, cfg


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save(tmp_path_factory.mktemp("rope"), "gpt_tiny", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return save(tmp_path_factory.mktemp("learned"), "gpt2_tiny")


def record(saved, consumed: int) -> dict:
    """The metadata check_resume reads: the saved run's config and its consumed samples."""
    return {"config": dataclasses.asdict(saved), "step": 2, "consumed_samples": consumed}


def resumed(path, *more):
    return load_config(["data=synthetic", f"checkpoint.resume={path}", *more], world_size=1)


def test_a_rope_models_seq_length_may_change_at_resume(llama):
    path, saved = llama
    for seq in (32, 128):
        cfg = resumed(path, f"model.seq_length={seq}")
        assert cfg.model.seq_length == seq and cfg.model.hidden_size == saved.model.hidden_size
        meta = record(saved, 0)
        check_resume(cfg, meta, path, verbose=False)  # an import (nothing consumed): no allowance needed
        label = context_label(cfg.model, meta)
        assert f"seq_length 64 -> {seq} (RoPE: allowed at resume)" in label and "context 1024" in label


def test_after_consumed_samples_the_change_needs_allowing_and_says_what_the_data_does(llama, capsys):
    path, saved = llama
    meta = record(saved, 16)
    with pytest.raises(ConfigError, match=r"allow_config_change=\[model.seq_length\]") as info:
        check_resume(resumed(path, "model.seq_length=32"), meta, path, verbose=False)
    assert "same token count" in str(info.value) and "\n" not in str(info.value)
    allowed = resumed(path, "model.seq_length=32", "checkpoint.allow_config_change=[model.seq_length]")
    check_resume(allowed, meta, path, verbose=True)
    assert "model.seq_length changed from 64 to 32" in capsys.readouterr().err


def test_the_data_goes_on_at_the_same_token_count():
    meta = {"config": {"model": {"seq_length": 64}}, "step": 2, "consumed_samples": 10}
    assert resume_position(meta, 64) == (10, 640)
    assert resume_position(meta, 32) == (20, 640)
    assert resume_position(meta, 128) == (5, 640)
    assert resume_position(meta, 100) == (7, 640)  # rounded up: no sample read twice at the seam
    acct = Accounting(2, 20, 4, 32, 640)
    assert acct.consumed(3) == 24 and acct.consumed_tokens(3) == 640 + 4 * 32


def test_a_learned_position_model_refuses_and_says_why(gpt2):
    path, saved = gpt2
    with pytest.raises(ConfigError, match="learned-position model") as info:
        resumed(path, "model.seq_length=32")
    assert "64 rows" in str(info.value) and "\n" not in str(info.value)
    # resume=auto adopts nothing: the resume check refuses it too, even when allowed
    cfg = load_config(["model=gpt2_tiny", *TINY[:-1], "model.seq_length=32"], world_size=1)
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, allow_config_change=["model.seq_length"])
    )
    meta = record(saved, 0)
    with pytest.raises(ConfigError, match="learned-position model"):
        check_resume(cfg, meta, path, verbose=False)


def test_export_keeps_the_models_own_context_unless_told(llama, gpt2, tmp_path, capsys):
    path, _ = llama
    trained = save(tmp_path / "ck", "gpt_tiny", max_position_embeddings=1024, seq_length=32)[0]
    assert export_hf.main([str(trained), str(tmp_path / "own")]) == 0
    assert json.loads((tmp_path / "own" / "config.json").read_text())["max_position_embeddings"] == 1024
    assert export_hf.main([str(trained), str(tmp_path / "n"), "--max-position-embeddings", "32"]) == 0
    assert json.loads((tmp_path / "n" / "config.json").read_text())["max_position_embeddings"] == 32
    # learned positions: the table's rows, nothing else
    capsys.readouterr()
    assert export_hf.main([str(gpt2[0]), str(tmp_path / "g"), "--max-position-embeddings", "99"]) == 2
    assert "learned-position model" in capsys.readouterr().err and not (tmp_path / "g").exists()
    assert export_hf.main([str(trained), str(tmp_path / "z"), "--max-position-embeddings", "0"]) == 2


def test_import_records_the_hf_context_and_the_header_shows_its_rope_scaling(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters=dict(LLAMA32, rope_theta=500000.0),
    )
    LlamaForCausalLM(hf).save_pretrained(str(tmp_path / "src"))
    assert import_hf.main([str(tmp_path / "src"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    cfg = resumed(tmp_path / "ck" / "step_00000000", "model.seq_length=128")
    assert cfg.model.max_position_embeddings == 1024 and cfg.model.seq_length == 128
    label = context_label(cfg.model, None)
    assert label == "seq 128, rope llama3 x32, context 1024"
