"""RoPE scaling as transformers defines it (model.rope_scaling): Llama 3.1- and 3.2-shaped tiny checkpoints
(llama3 scaling), and linear / yarn ones, import with logits equal to LlamaForCausalLM's at positions far
beyond original_max_position_embeddings; export gives back the same config and tensors; a type no fixed
table reproduces (dynamic) exits 2 naming it. Tiny random models made here, offline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import megaframe
from megaframe.config import load_config
from megaframe.errors import ConfigError
from tests.e2e.helpers import run
from tests.unit.hf_scripts import export_hf, import_hf

ROOT = Path(__file__).resolve().parents[3]
ORIGINAL = 32  # the "pretraining context": every test sequence runs to 4x past it
SCALINGS = {
    # Llama 3.1 8B's rope_scaling (factor 8), untied; Llama 3.2 1B's (factor 32), tied
    "llama3.1": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        False,
    ),
    "llama3.2": (
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        True,
    ),
    "linear": ({"rope_type": "linear", "factor": 4.0}, False),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, False),
    "yarn_mscale": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            "mscale": 0.707,
            "mscale_all_dim": 0.5,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        True,
    ),
}


def hf_llama(folder: Path, scaling: dict, tied: bool):
    """A random tiny LlamaForCausalLM with `scaling`, theta 500000 (Llama 3's), saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * ORIGINAL,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms off 1.0, so a norm mapped wrong shows
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("case", list(SCALINGS))
def test_import_matches_transformers_beyond_original_context(tmp_path, case):
    scaling, tied = SCALINGS[case]
    ref = hf_llama(tmp_path / "hf", scaling, tied)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    model = megaframe.load_model(str(tmp_path / "ck"))
    assert model.cfg.rope_scaling.rope_type == scaling["rope_type"]
    assert model.cfg.seq_length == 4 * ORIGINAL
    ids = torch.randint(0, 256, (2, 4 * ORIGINAL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids)
    beyond = slice(ORIGINAL, None)  # the positions the scaling exists for
    assert (got[:, beyond] - want[:, beyond]).abs().max().item() <= 1e-4
    assert (got - want).abs().max().item() <= 1e-4
    # and the scaling matters there: plain RoPE would be far off
    assert (model.rope[0] - _plain_cos(model)).abs().max() > 1e-2

    assert export_hf.main([str(tmp_path / "ck"), str(tmp_path / "back")]) == 0
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), local_files_only=True).eval()
    # every key the source set comes back equal (the export may spell out yarn's beta defaults too)
    from megaframe.models.hf_rope import rope_from_hf

    got_params = back.config.rope_parameters
    assert all(got_params.get(k) == v for k, v in ref.config.rope_parameters.items() if v is not None)
    assert rope_from_hf(back.config) == rope_from_hf(ref.config)
    sd, sd_back = ref.state_dict(), back.state_dict()
    assert set(sd) == set(sd_back) and all(torch.equal(sd[k], sd_back[k]) for k in sd)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def _plain_cos(model):
    from megaframe.model.rope import rope_tables

    return rope_tables(model.cfg.seq_length, model.cfg.head_dim, model.cfg.rope_theta)[0]


def test_dynamic_scaling_exits_2_naming_it(tmp_path):
    hf_llama(tmp_path / "hf", {"rope_type": "dynamic", "factor": 2.0}, False)
    # a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the script's exit
    # code and message, not the interpreter's start
    r = run(
        [
            sys.executable,
            "scripts/import_hf.py",
            str(tmp_path / "hf"),
            str(tmp_path / "ck"),
            "data=synthetic",
        ],
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "'dynamic'" in r.stderr and "not supported" in r.stderr
    assert not (tmp_path / "ck" / "latest").exists()


def test_config_refuses_scaling_without_its_fields():
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        load_config(
            ["data=synthetic", "model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8"],
            world_size=1,
            check_data=False,
        )
    with pytest.raises(ConfigError, match="rope_type"):
        load_config(
            ["data=synthetic", "model.rope_scaling.rope_type=dynamic"], world_size=1, check_data=False
        )


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn"])
def test_config_refuses_scaling_on_a_model_without_rope(kind):
    """A learned-position model (gpt2) has no RoPE to scale: the scaling was accepted and did nothing."""
    over = ["data=synthetic", "model=gpt2_tiny", f"model.rope_scaling.rope_type={kind}"]
    over += ["model.rope_scaling.factor=2", "model.rope_scaling.original_max_position_embeddings=16"]
    refused = f"model.rope_scaling: rope_type={kind} scales RoPE, but model.position_embedding=learned"
    with pytest.raises(ConfigError, match=refused):
        load_config(over, world_size=1, check_data=False)
    plain = load_config(["data=synthetic", "model=gpt2_tiny"], world_size=1, check_data=False)
    assert plain.model.rope_scaling.rope_type == "default"  # the default scaling stays accepted


def test_config_scaling_reaches_the_model():
    """model.rope_scaling overrides build the scaled table: equal to plain RoPE on the high frequencies,
    slowed by `factor` on the low ones (gpt_tiny, theta 10000, head dim 32, pretraining context 32)."""
    from megaframe.model.gpt import GPT
    from megaframe.parallel.mesh import single_process_mesh

    cfg = load_config(
        [
            "data=synthetic",
            "model.rope_scaling.rope_type=llama3",
            "model.rope_scaling.factor=8",
            "model.rope_scaling.original_max_position_embeddings=32",
        ],
        world_size=1,
        check_data=False,
    )
    model = GPT(cfg.model, single_process_mesh("cpu"))
    plain = _plain_cos(model)
    assert torch.equal(model.rope[0][:, 0], plain[:, 0])  # wavelength 2 pi < 32 / 4: kept
    assert not torch.allclose(model.rope[0][:, 15], plain[:, 15])  # wavelength ~ 2 pi 10^3.75 > 32: scaled


def test_train_continues_an_imported_llama3_checkpoint(tmp_path):
    """train.py takes the scaling from the checkpoint (no model.* overrides) and trains on from it."""
    import json

    hf_llama(tmp_path / "hf", SCALINGS["llama3.2"][0], True)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    r = run(
        [
            sys.executable,
            "train.py",
            f"checkpoint.resume={tmp_path / 'ck'}",
            "data=synthetic",
            "train.max_steps=1",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            f"run.dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'run' / 'ck'}",
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "run" / "ck" / "step_00000001" / "metadata.json").read_text())
    assert meta["config"]["model"]["rope_scaling"]["rope_type"] == "llama3"
    assert meta["config"]["model"]["rope_scaling"]["factor"] == 32.0


def test_checkpoints_without_the_new_keys_still_load(tmp_path):
    """A checkpoint whose recorded model config predates rope_scaling / kv_channels / qk_norm loads, exports
    and resumes with plain RoPE."""
    import json

    hf_llama(tmp_path / "hf", {"rope_type": "default"}, False)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    meta_path = tmp_path / "ck" / "step_00000000" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for k in ("rope_scaling", "kv_channels", "qk_norm"):
        del meta["config"]["model"][k]
    meta_path.write_text(json.dumps(meta))
    model = megaframe.load_model(str(tmp_path / "ck"))
    assert model.cfg.rope_scaling.rope_type == "default" and model.cfg.kv_channels is None
    assert export_hf.main([str(tmp_path / "ck"), str(tmp_path / "back")]) == 0
    cfg = load_config(
        [f"checkpoint.resume={tmp_path / 'ck' / 'step_00000000'}", "data=synthetic"],
        world_size=1,
        check_data=False,
    )
    assert cfg.model.rope_scaling.rope_type == "default" and cfg.model.hidden_size == 64
