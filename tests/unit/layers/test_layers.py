"""Single-process layers: Shard slicing, layout-free init,
the GPT at tp=1, and attention vs a hand reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megaframe.config import ModelConfig
from megaframe.layers.shard import Shard, full_init, init_model, init_rule, param_seed, sharded_param
from megaframe.layers.vocab import vocab_parallel_cross_entropy
from megaframe.model.attention import Attention, rope_tables
from megaframe.model.gpt import GPT
from megaframe.optim.grads import clip_grads, grad_norm
from megaframe.parallel.mesh import single_process_mesh

LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    seq_length=16,
    vocab_size=64,
    init_std=0.2,
)
GPT2 = dict(
    LLAMA,
    num_query_groups=None,
    norm="layernorm",
    activation="gelu",
    position_embedding="learned",
    tie_embeddings=True,
    bias=True,
)
FAMILIES = {"llama": LLAMA, "gpt2": GPT2}


# ---------------------------------------------------------------- Shard


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_fused_shard_local_then_place_reassembles(size, dim):
    shape = (16, 3) if dim == 0 else (3, 16)
    full = torch.arange(48.0).reshape(shape)
    rebuilt = torch.full(shape, -1.0)
    for r in range(size):
        s = Shard(shape, dim, (8, 4, 4), r, size)
        local = s.local(full)
        assert local.shape == s.local_shape
        assert s.local_shape[dim] == 16 // size and s.local_shape[1 - dim] == 3
        # rank r holds [q_r | k_r | v_r]: each fused block split over ranks on its own
        q, k, v = full.split([8, 4, 4], dim=dim)
        expect = torch.cat([q.chunk(size, dim)[r], k.chunk(size, dim)[r], v.chunk(size, dim)[r]], dim=dim)
        assert torch.equal(local, expect)
        s.place(rebuilt, local, r)
    assert torch.equal(rebuilt, full)


def test_shard_ranges_by_hand():
    s = Shard((16, 3), 0, (8, 4, 4), rank=1, size=2)
    assert s.ranges() == [(4, 0, 4), (10, 4, 2), (14, 6, 2)]
    assert s.ranges(0) == [(0, 0, 4), (8, 4, 2), (12, 6, 2)]
    s4 = Shard((16, 3), 0, (8, 4, 4), rank=0, size=4)
    assert s4.ranges(3) == [(6, 0, 2), (11, 2, 1), (15, 3, 1)]
    assert s4.local_shape == (4, 3)


def test_shard_defaults_and_errors():
    rep = Shard((5, 7))
    full = torch.randn(5, 7)
    assert rep.local_shape == (5, 7) and rep.local(full) is full
    plain = Shard((8, 2), 0, (), rank=1, size=2)  # no parts: one block
    assert plain.parts == (8,) and plain.ranges() == [(4, 0, 4)]
    with pytest.raises(AssertionError):
        Shard((16, 3), 0, (8, 4, 4), 0, 8)  # 4 rows do not split over 8 ranks
    with pytest.raises(AssertionError):
        Shard((16, 3), 0, (8, 4), 0, 2)  # parts do not add up


# ---------------------------------------------------------------- init


def test_init_rule():
    std, layers = 0.02, 8
    assert init_rule("layers.0.attn_norm.weight", std, layers) == ("ones", 0.0)
    assert init_rule("final_norm.weight", std, layers) == ("ones", 0.0)
    assert init_rule("final_norm.bias", std, layers) == ("zeros", 0.0)
    assert init_rule("layers.3.attn.qkv.bias", std, layers) == ("zeros", 0.0)
    assert init_rule("layers.3.mlp.down_proj.bias", std, layers) == ("zeros", 0.0)
    for name in ("layers.3.attn.out_proj.weight", "layers.3.mlp.down_proj.weight"):
        kind, s = init_rule(name, std, layers)
        assert kind == "normal" and s == pytest.approx(0.02 / 4.0)
    for name in (
        "embed.weight",
        "head.weight",
        "pos_embed",
        "layers.0.attn.qkv.weight",
        "layers.0.mlp.up_proj.weight",
    ):
        assert init_rule(name, std, layers) == ("normal", std)


def test_full_init_is_deterministic_and_keyed_by_name_and_seed():
    a = full_init("layers.0.attn.qkv.weight", (64, 32), 7, 0.02, 2)
    assert torch.equal(a, full_init("layers.0.attn.qkv.weight", (64, 32), 7, 0.02, 2))
    assert not torch.equal(a, full_init("layers.1.attn.qkv.weight", (64, 32), 7, 0.02, 2))
    assert not torch.equal(a, full_init("layers.0.attn.qkv.weight", (64, 32), 8, 0.02, 2))
    assert param_seed(7, "x") == param_seed(7, "x") != param_seed(8, "x")
    assert 0 <= param_seed(7, "x") < 2**63
    big = full_init("embed.weight", (256, 256), 1, 0.02, 2)
    assert big.std().item() == pytest.approx(0.02, rel=0.03) and abs(big.mean().item()) < 1e-3
    out = full_init("layers.0.attn.out_proj.weight", (256, 256), 1, 0.02, 8)
    assert out.std().item() == pytest.approx(0.02 / 4.0, rel=0.03)
    assert torch.equal(full_init("final_norm.weight", (9,), 1, 0.02, 2), torch.ones(9))
    assert torch.equal(full_init("layers.0.attn.qkv.bias", (9,), 1, 0.02, 2), torch.zeros(9))


@pytest.mark.parametrize("size", [2, 4])
def test_init_model_keeps_each_ranks_slice_of_the_same_full_tensor(size):
    full = full_init("w", (16, 5), 3, 0.02, 2)
    for r in range(size):
        m = nn.Module()
        m.w = sharded_param(Shard((16, 5), 0, (8, 4, 4), r, size), "cpu")
        init_model(m, 3, 0.02, 2)
        assert torch.equal(m.w.data, m.w.placement.shard.local(full))


# ---------------------------------------------------------------- GPT at tp=1


def make_gpt(family: str, seed: int = 0, **kw) -> GPT:
    model = GPT(ModelConfig(**{**FAMILIES[family], **kw}), single_process_mesh())
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpt_loss_equals_cross_entropy_of_logits(family):
    model = make_gpt(family)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 16), generator=g)
    labels = torch.randint(0, 64, (3, 16), generator=g)
    logits = model(ids)
    assert logits.shape == (3, 16, 64)
    loss = model(ids, labels)
    assert loss.shape == (3, 16)
    ref = F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), reduction="none").view(3, 16)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert logits.std() > 0.05  # not a degenerate (uniform) model
    if family == "gpt2":
        assert not hasattr(model, "head") and model.rope is None
    names = {n for n, _ in model.named_parameters()}
    assert ("head.weight" in names) == (family == "llama") and ("pos_embed" in names) == (family == "gpt2")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpt_is_causal(family):
    model = make_gpt(family)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_gpt_init_is_seeded():
    a, b, c = make_gpt("llama", 5), make_gpt("llama", 5), make_gpt("llama", 6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), n


def test_vocab_parallel_cross_entropy_backward_matches_autograd():
    mesh = single_process_mesh()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2, 11, generator=g) * 3
    target = torch.randint(0, 11, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x1, target, mesh.tp)
    (loss * w).sum().backward()
    ref = F.cross_entropy(x2.reshape(-1, 11), target.reshape(-1), reduction="none").view(5, 2)
    (ref * w).sum().backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x1.grad, x2.grad)


def test_grad_norm_and_clip_at_tp1():
    model = make_gpt("gpt2")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    model(ids, ids).sum().backward()
    mesh = single_process_mesh()
    ref = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    norm = grad_norm(model, mesh)
    torch.testing.assert_close(norm, ref)
    clip_grads(model, norm, 0.0)  # disabled: unchanged
    torch.testing.assert_close(grad_norm(model, mesh), ref)
    clip_grads(model, norm, float(ref) * 10)  # under the limit: unchanged
    torch.testing.assert_close(grad_norm(model, mesh), ref)
    clip_grads(model, norm, float(ref) / 4)
    torch.testing.assert_close(grad_norm(model, mesh), ref / 4, rtol=1e-4, atol=0)


# ---------------------------------------------------------------- attention vs a hand reference


def reference_attention(attn: Attention, x_SBD: torch.Tensor, rope_theta: float | None) -> torch.Tensor:
    s, b, _ = x_SBD.shape
    h, k, e = attn.heads, attn.groups, attn.head_dim
    qkv = x_SBD @ attn.qkv.weight.T + (attn.qkv.bias if attn.qkv.bias is not None else 0)
    q = qkv[..., : h * e].reshape(s, b, h, e)
    kk = qkv[..., h * e : (h + k) * e].reshape(s, b, k, e)
    v = qkv[..., (h + k) * e :].reshape(s, b, k, e)

    def rope(t):  # rotate-half: pair dim i with i + e/2, angle p * theta^(-2i/e)
        if rope_theta is None:
            return t
        out = torch.empty_like(t)
        for p in range(s):
            for i in range(e // 2):
                a = p * rope_theta ** (-2.0 * i / e)
                c, sn = math.cos(a), math.sin(a)
                x1, x2 = t[p, ..., i], t[p, ..., i + e // 2]
                out[p, ..., i], out[p, ..., i + e // 2] = x1 * c - x2 * sn, x2 * c + x1 * sn
        return out

    q, kk = rope(q), rope(kk)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    heads = []
    for j in range(h):
        g = j // (h // k)  # query head j reads kv group j // (h / k)
        out_b = []
        for bi in range(b):
            scores = q[:, bi, j] @ kk[:, bi, g].T / math.sqrt(e)
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            out_b.append(probs @ v[:, bi, g])
        heads.append(torch.stack(out_b, dim=1))
    o = torch.cat(heads, dim=-1)
    return o @ attn.out_proj.weight.T + (attn.out_proj.bias if attn.out_proj.bias is not None else 0)


@pytest.mark.parametrize(
    "groups,bias,use_rope", [(2, False, True), (1, False, True), (4, True, True), (4, True, False)]
)
def test_attention_matches_reference(groups, bias, use_rope):
    cfg = ModelConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        seq_length=12,
        bias=bias,
        rope_theta=100.0,
    )
    attn = Attention(cfg, single_process_mesh().tp, sp=False)
    g = torch.Generator().manual_seed(groups + 10 * bias)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(12, 2, 32, generator=g)
    rope = rope_tables(cfg.seq_length, cfg.head_dim, cfg.rope_theta) if use_rope else None
    with torch.no_grad():
        got = attn(x, rope)
    want = reference_attention(attn, x, cfg.rope_theta if use_rope else None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
