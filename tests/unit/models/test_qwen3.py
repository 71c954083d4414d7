"""Qwen3 (per-head q/k RMSNorm, GQA, head dim apart from hidden/heads, RoPE theta 1e6, tied or untied):
a random tiny Qwen3ForCausalLM imports with logits equal to transformers' (fp32, <= 1e-4) and exports back
to the same tensors and logits; the presets build. Tiny models made here, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megaframe
from megaframe.checkpoint import hf
from megaframe.config import load_config
from tests.unit.hf_scripts import export_hf, import_hf

ROOT = Path(__file__).resolve().parents[3]


def hf_qwen3(folder: Path, tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    # head_dim 24: 4 heads x 24 = 96 != hidden 64, as Qwen3-0.6B's 16 x 128 != 1024
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # every norm (the q/k ones too) off 1.0, so one mapped wrong shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_import_and_export_match_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    ref = hf_qwen3(tmp_path / "hf", tied)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    model = megaframe.load_model(str(tmp_path / "ck"))
    assert model.cfg.qk_norm and model.cfg.head_dim == 24 and model.cfg.tie_embeddings == tied
    assert hf.family(model.cfg) == "qwen3"
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        assert (model(ids) - want).abs().max().item() <= 1e-4

    assert export_hf.main([str(tmp_path / "ck"), str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), local_files_only=True).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    sd, sd_back = ref.state_dict(), back.state_dict()
    assert set(sd) == set(sd_back) and all(torch.equal(sd[k], sd_back[k]) for k in sd)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def test_cached_decode_matches_transformers_generate(tmp_path):
    """The KV-cached decode path (inference/kv.py) normalises q and k as the training forward does:
    greedy tokens equal transformers' greedy generate."""
    from megaframe.inference.decode import generate
    from megaframe.inference.sampling import SamplingConfig

    ref = hf_qwen3(tmp_path / "hf", True)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    model = megaframe.load_model(str(tmp_path / "ck"))
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    want = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    got = generate(model, ids[0].tolist(), 12, SamplingConfig(temperature=0.0), 256)
    assert got.tokens == want


@pytest.mark.parametrize("preset", ["qwen3_tiny", "qwen3_0_6b"])
def test_presets_are_qwen3(preset):
    cfg = load_config([f"model={preset}", "data=synthetic"], world_size=1, check_data=False)
    assert hf.family(cfg.model) == "qwen3"
    if preset == "qwen3_0_6b":  # Qwen3-0.6B's published size, embeddings tied
        from megaframe.models.registry import family

        assert family("qwen3").total_params(cfg.model) == 596_049_920


def test_twenty_training_steps_match_transformers(tmp_path):
    """megaframe's training step (its schedule, loss, grad clipping and AdamW) on an imported Qwen3 and
    torch AdamW on Qwen3ForCausalLM, same weights, data, warmup + cosine LR and clipping: the 20 losses
    agree to fp32 noise."""
    import torch.nn.functional as F

    from megaframe.optim.build import build_optimizer
    from megaframe.optim.lr_schedule import lr_at
    from megaframe.parallel.mesh import single_process_mesh
    from tests.forms import build_data, microbatches, train_step

    ref = hf_qwen3(tmp_path / "hf", True).train()
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    steps, gbs = 20, 4
    cfg = load_config(
        [
            f"checkpoint.resume={tmp_path / 'ck' / 'step_00000000'}",
            "data=synthetic",
            f"train.max_steps={steps}",
            f"train.global_batch_size={gbs}",
            "train.micro_batch_size=2",
            "optim.lr=3e-3",
            "optim.warmup_steps=3",
            "optim.clip_grad=0.5",
            "optim.weight_decay=0.1",
        ],
        world_size=1,
        check_data=False,
    )
    mesh = single_process_mesh()
    model = megaframe.load_model(str(tmp_path / "ck")).train()
    optimizer = build_optimizer(model, cfg.optim, mesh)
    o = cfg.optim
    params = list(ref.parameters())  # the tied embedding once
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    data = build_data(cfg)
    ours, theirs = [], []
    for step in range(1, steps + 1):
        batches = microbatches(data, step - 1, gbs, 2, 0, 1, cfg.train.seed)
        res = train_step(model, optimizer, batches, mesh, cfg, step)
        ours.append(res.loss_sum.item() / (gbs * cfg.model.seq_length))
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        adam.zero_grad()
        loss = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        for g in adam.param_groups:
            g["lr"] = lr_at(step, o.lr, o.min_lr, o.warmup_steps, steps, o.lr_schedule, o.wsd_decay_fraction)
        adam.step()
        theirs.append(loss.item())
    rel = max(abs(a - b) / b for a, b in zip(ours, theirs))
    print(f"20 steps: max rel loss diff {rel:.2e}, loss {ours[0]:.4f} -> {ours[-1]:.4f}")
    assert rel <= 1e-4, (rel, ours, theirs)
    assert ours[-1] < ours[0]  # it trained
