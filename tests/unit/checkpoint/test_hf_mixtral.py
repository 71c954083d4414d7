"""Mixtral interop: a megaframe MoE checkpoint -> MixtralForCausalLM -> megaframe, logits equal both ways
(fp32, max abs diff <= 1e-5); the exported folder (with its tokenizer) generates with transformers.pipeline;
an MoE model transformers cannot express is refused in one line."""

from __future__ import annotations

import torch

import megaframe
from tests.unit.checkpoint.test_hf_interop import export_hf, ids, import_hf, make_checkpoint, tokenizer_dir  # noqa: F401

MOE = [
    "model=moe_tiny",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.moe_ffn_hidden_size=32",
    "model.num_experts=4",
]


def test_mixtral_round_trip_and_pipeline(tmp_path, tokenizer_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, pipeline

    cfg, model = make_checkpoint(tmp_path / "ckpt", MOE, str(tokenizer_dir))
    assert export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    x = ids(cfg)
    with torch.no_grad():
        ref = model(x)
        err_export = (hf_model(x).logits - ref).abs().max().item()
    assert err_export <= 1e-5, err_export
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "back"), "data=synthetic"]) == 0
    back = megaframe.load_model(str(tmp_path / "back"))
    assert (back.cfg.num_experts, back.cfg.moe_top_k, back.cfg.expert_ffn) == (4, 2, 32)
    with torch.no_grad():
        err_import = (back(x) - ref).abs().max().item()
    assert err_import <= 1e-5, err_import
    gen = pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    out = gen("the quick brown", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert out.startswith("the quick brown") and len(out) > len("the quick brown")


def test_unexpressible_moe_is_refused(tmp_path, capsys):
    make_checkpoint(tmp_path / "ckpt", MOE + ["model.moe_router_score=sigmoid"])
    assert export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "moe_router_score=sigmoid" in err and "\n" not in err and not (tmp_path / "hf").exists()
