"""DeepSeek-V3 beyond the family conformance test (tests/unit/models/test_family_conformance.py, which runs
its tiny preset: query latent, 4 expert groups, a dense first layer, one MTP depth): logits equal to
transformers' DeepseekV3ForCausalLM for the other shapes (no query latent as V2-Lite, YaRN with DeepSeek's
mscale, the raw top-k scores, one group), the MTP depth's loss and its weight in the objective, the
sequence-wise balance loss, and the other families refusing its fields."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaframe.checkpoint import hf
from megaframe.config import load_config
from megaframe.errors import ConfigError
from megaframe.model.moe import router
from megaframe.parallel.mesh import single_process_mesh
from tests.unit.models.test_family_conformance import ids, perturbed, tiny

YARN = [
    "model.rope_scaling.rope_type=yarn",
    "model.rope_scaling.factor=4",
    "model.rope_scaling.original_max_position_embeddings=8",
    "model.rope_scaling.mscale=0.707",
    "model.rope_scaling.mscale_all_dim=0.707",
]


def test_exported_files_give_transformers_logits_and_every_tensor_back(tmp_path):
    """A shape the conformance test does not build (no query latent as V2-Lite, YaRN with DeepSeek's
    mscale, the raw top-k scores, one group): scripts/export_hf.py's folder gives transformers' logits, and
    carries the MTP depth as DeepSeek's files do (layer num_layers: its block, enorm, hnorm, eh_proj,
    shared_head) beside what transformers' class holds; the folder's import reads every tensor back."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from megaframe.checkpoint import sharded
    from megaframe.parallel.mesh import single_process_mesh
    from tests.unit.hf_scripts import export_hf, import_hf

    cfg = tiny(
        "deepseek_v3",
        "model.q_lora_rank=null",
        "model.moe_n_group=1",
        "model.moe_topk_group=1",
        "model.moe_norm_topk_prob=false",
        *YARN,
    )
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=""))
    model = perturbed(cfg)
    meta = {"consumed_samples": 0, "config": dataclasses.asdict(cfg)}
    sharded.save(tmp_path / "ck", 3, model, import_hf.WeightsOnly(), single_process_mesh(), meta)
    out = export_hf.export(str(tmp_path / "ck"), tmp_path / "hf", "fp32")
    x = ids(cfg)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
        err = (theirs(x).logits - model(x)).abs().max().item()
    assert err <= 1e-5, err
    fields, back = hf.from_hf(out)
    state = {n: p.detach() for n, p in model.named_parameters()}
    assert fields["mtp_num_layers"] == 1 and any(k.startswith("mtp.0.") for k in back)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_mtp_depth_loss_and_its_weight_in_the_objective():
    """Depth 1 scores token p+2 at each position p < S-1 from the last block's output and the embedding of
    token p+1; the objective's MTP term is mtp_loss_weight x its token-loss sum over the loss's tokens."""
    cfg = tiny("deepseek_v3", "model.moe_seq_aux_loss_coeff=0")  # no router loss reaching eh_proj
    model = perturbed(cfg).train()
    x = ids(cfg)
    y = torch.roll(x, -1, dims=1)
    seen = {}
    last = model.layers[str(cfg.model.num_layers - 1)]
    last.register_forward_hook(lambda mod, args, out: seen.setdefault("h", out))
    loss_BS = model(x, y)
    depth = model.mtp["0"]
    h_SBD = depth(seen["h"], model.embed(y.t()), model.rope)
    logits_SBV = model.head(depth.final_norm(h_SBD))
    v = logits_SBV.shape[-1]
    ref = F.cross_entropy(logits_SBV[:-1].reshape(-1, v), y.t()[1:].reshape(-1), reduction="sum")
    b, s = x.shape
    assert torch.allclose(model.mtp_stats[0, 0].float(), ref.detach(), rtol=1e-5)
    assert model.mtp_stats[0, 1].item() == b * (s - 1)
    w = model.mtp["0"].eh_proj.weight
    (want,) = torch.autograd.grad(ref, w, retain_graph=True)
    (got,) = torch.autograd.grad(loss_BS.sum(), w)
    # each token loss's grad in the objective: 1 / the step's tokens (the model's tokens_per_step)
    scale = cfg.model.mtp_loss_weight / model.tokens_per_step
    torch.testing.assert_close(got, want * scale, rtol=1e-4, atol=1e-8)


def test_sequence_balance_loss_is_one_when_balanced_and_sums_over_split_tokens():
    e, k, b, s = 4, 2, 2, 8
    probs_TE = torch.full((s * b, e), 1 / e)
    counts_BE = torch.full((b, e), k * s // e)
    assert router.sequence_balancing_loss(probs_TE, counts_BE, s, k).item() == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(0)
    probs_TE = torch.softmax(torch.randn(s * b, e, generator=gen), -1)
    experts_TK = torch.topk(probs_TE, k).indices
    counts_BE = router.sequence_counts(experts_TK, b, e)
    whole = router.sequence_balancing_loss(probs_TE, counts_BE, s, k)
    # two sequence blocks (sp or cp ranks), each its own tokens' share with the whole sequences' counts
    half = s * b // 2
    shares = sum(router.sequence_balancing_loss(p, counts_BE, s, k) for p in probs_TE.split(half))
    torch.testing.assert_close(shares, whole)


def test_other_families_refuse_its_fields():
    with pytest.raises(ConfigError) as e:
        load_config(
            ["model=llama_1b", "data=synthetic", "model.kv_lora_rank=32"], world_size=1, check_data=False
        )
    msg = str(e.value)
    assert "model.kv_lora_rank=32 (llama does not compute it; model.family=deepseek_v3 does)" in msg, msg
    # no family computes a DeepSeek config with a bad group count: the refusal points to none (not custom)
    with pytest.raises(ConfigError) as e:
        tiny("deepseek_v3", "model.moe_n_group=3")
    msg = str(e.value)
    assert "model.moe_n_group=3 (must divide model.num_experts=8)" in msg and "fit" not in msg, msg


def test_an_mtp_depths_moe_is_balanced_and_logged_as_the_layer_after_the_last():
    """The depth's MoE is global layer num_layers + k: its routed counts enter the step's table, its expert
    bias moves by the aux-loss-free update and `moe/layer{num_layers}` is logged."""
    from megaframe.model.moe import stats

    cfg = tiny("deepseek_v3", "model.moe_bias_update_rate=0.01")
    model = perturbed(cfg).train()
    n = cfg.model.num_layers
    assert [i for i, _ in stats.moe_layers(model)][-1] == n
    bias_E = model.mtp["0"].block.mlp.router.expert_bias
    before = bias_E.clone()
    x = ids(cfg)
    stats.begin_step(model)
    model(x, torch.roll(x, -1, dims=1)).sum().backward()
    mesh = single_process_mesh()
    stats.update_expert_bias(model, mesh)
    assert not torch.equal(bias_E, before)
    row = stats.metrics(model, mesh)
    assert row[f"moe/layer{n}/tokens_mean"] > 0
