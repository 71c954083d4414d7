"""Qwen3-MoE (Qwen3's attention with per-head q/k RMSNorm, every layer a softmax top-k MoE with the k
weights renormalised): a random tiny Qwen3MoeForCausalLM imports with logits equal to transformers'
(fp32, <= 1e-5) and exports back to the same tensors and logits; transformers 4's per-expert layout
converts both ways; what megaframe does not compute is refused in one line; the presets are the published
sizes. Tiny models made here, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megaframe
from megaframe.checkpoint import hf
from megaframe.config import load_config
from megaframe.models.llama.hf import split_layer_key
from megaframe.models.qwen3_moe import hf as qwen3_moe
from tests.unit.hf_scripts import export_hf, import_hf


def hf_qwen3_moe(folder: Path, **over):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    # head_dim 24: 4 heads x 24 = 96 != hidden 64, as Qwen3-30B-A3B's 32 x 128 != 2048
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.1,
        router_aux_loss_coef=0.001,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**kw, **over})).eval()
    with torch.no_grad():  # every norm off 1.0 and the router off zero, so one mapped wrong shows
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("mlp.gate.weight"):
                p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return model


def test_import_and_export_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    ref = hf_qwen3_moe(tmp_path / "hf")
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    model = megaframe.load_model(str(tmp_path / "ck"))
    m = model.cfg
    assert hf.family(m) == "qwen3_moe" and m.qk_norm and m.head_dim == 24 and not m.tie_embeddings
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.moe_aux_loss_coeff) == (8, 4, 32, 0.001)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        err = (model(ids) - want).abs().max().item()
    print(f"qwen3_moe import: max abs logit diff {err:.2e}")
    assert err <= 1e-5, err

    assert export_hf.main([str(tmp_path / "ck"), str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), local_files_only=True).eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM" and back.config.norm_topk_prob
    sd, sd_back = ref.state_dict(), back.state_dict()
    assert set(sd) == set(sd_back) and all(torch.equal(sd[k], sd_back[k]) for k in sd)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def test_per_expert_layout_converts_both_ways():
    """transformers 4 (and the published safetensors) hold one gate/up/down per expert: exported that
    way and read back, the state is the same tensors."""
    from megaframe.parallel.mesh import single_process_mesh
    from tests.forms import build_model

    cfg = load_config(["model=qwen3_moe_tiny", "data=synthetic", "model.num_layers=2"], world_size=1)
    state = {n: p.detach() for n, p in build_model(cfg, single_process_mesh()).named_parameters()}
    sd = {}
    for name, t in state.items():
        i, rest = split_layer_key(name) or (None, None)
        if rest in qwen3_moe.MOE:
            sd.update(qwen3_moe.experts_out(i, rest, t, stacked=False))
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in sd
    hf_cfg, _ = hf.to_hf(cfg.model, state)
    for i in range(2):
        for name, t in qwen3_moe.experts_in(hf_cfg, sd, i).items():
            assert torch.equal(t, state[name]), name


@pytest.mark.parametrize(
    "over,named",
    [
        (dict(norm_topk_prob=False), "norm_topk_prob=false"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
        (dict(mlp_only_layers=[0]), "mlp_only_layers=[0]"),
    ],
    ids=["unnormalised-topk", "sparse-step", "dense-layer"],
)
def test_what_megaframe_does_not_compute_is_refused(tmp_path, capsys, over, named):
    hf_qwen3_moe(tmp_path / "hf", **over)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 2
    # the last line (transformers' loading bar comes before it)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megaframe: error:") and named in err
    assert not (tmp_path / "ck" / "step_00000000").exists()


def test_router_options_transformers_lacks_refuse_the_export():
    over = ["model=qwen3_moe_tiny", "data=synthetic", "model.moe_router_score=sigmoid"]
    cfg = load_config(over, world_size=1)
    with pytest.raises(ValueError, match="moe_router_score=sigmoid"):
        hf.to_hf(cfg.model, {})


@pytest.mark.parametrize(
    "preset,total_want,active_want",
    [("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704), ("qwen3_235b_a22b", 235_093_634_560, 22_190_763_520)],
)
def test_qwen3_moe_presets_are_the_published_sizes(preset, total_want, active_want):
    """30.5B / 3.3B and 235B / 22B parameters, total / active per token (the model cards); the dims their
    config.json files have."""
    m = load_config([f"model={preset}", "data=synthetic"], world_size=1, check_data=False).model
    from megaframe.models.registry import family

    total = family("qwen3_moe").total_params(m)
    idle = m.num_layers * (m.num_experts - m.moe_top_k) * 3 * m.hidden_size * m.expert_ffn
    assert total == total_want and total - idle == active_want
