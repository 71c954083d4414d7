"""GPT-2 <-> megaframe (checkpoint/hf.py's module docstring has the megaframe names and layouts).

GPT-2 is layernorm, tanh GELU, learned positions, no GQA. Conv1D weights are stored [in, out], so
c_attn = qkv.weight.T [D, 3D], c_proj = out_proj.weight.T, c_fc = up_proj.weight.T [D, F],
mlp.c_proj = down_proj.weight.T [F, D]; wpe = pos_embed with n_positions = S.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaframe.config.schema import ModelConfig

if TYPE_CHECKING:
    import torch

GPT2_LAYER = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "mlp_norm.weight": "ln_2.weight",
    "mlp_norm.bias": "ln_2.bias",
    "attn.qkv.weight": "attn.c_attn.weight",
    "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out_proj.weight": "attn.c_proj.weight",
    "attn.out_proj.bias": "attn.c_proj.bias",
    "mlp.up_proj.weight": "mlp.c_fc.weight",
    "mlp.up_proj.bias": "mlp.c_fc.bias",
    "mlp.down_proj.weight": "mlp.c_proj.weight",
    "mlp.down_proj.bias": "mlp.c_proj.bias",
}
GPT2_TOP = {
    "embed.weight": "transformer.wte.weight",
    "pos_embed": "transformer.wpe.weight",
    "final_norm.weight": "transformer.ln_f.weight",
    "final_norm.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
}
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def to_hf(m: ModelConfig, state: dict[str, torch.Tensor], eos=None, bos=None):
    sd = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if not name.startswith("layers."):
            if name not in GPT2_TOP:
                raise ValueError(f"unexpected megaframe tensor {name!r} for a gpt2 export")
            sd[GPT2_TOP[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest not in GPT2_LAYER:
            raise ValueError(f"unexpected megaframe tensor {name!r} for a gpt2 export")
        # Conv1D stores [in, out]: a matrix is transposed both ways, vectors pass as they are
        sd[f"transformer.h.{i}.{GPT2_LAYER[rest]}"] = t.t().contiguous() if t.ndim == 2 else t
    if not m.bias:  # GPT-2's Conv1D layers always carry biases: export zeros
        _add_zero_gpt2_biases(m, sd)
    return _gpt2_config(m, eos, bos), sd


def _add_zero_gpt2_biases(m: ModelConfig, sd: dict) -> None:
    # torch imported here: the config checks read this family's spec before any rank imports torch
    import torch

    d, f = m.hidden_size, m.ffn_hidden_size
    for i in range(m.num_layers):
        for key, n in (("attn.c_attn", 3 * d), ("attn.c_proj", d), ("mlp.c_fc", f), ("mlp.c_proj", d)):
            sd.setdefault(f"transformer.h.{i}.{key}.bias", torch.zeros(n))


def _gpt2_config(m: ModelConfig, eos, bos):
    from transformers import GPT2Config

    cfg = GPT2Config(
        vocab_size=m.vocab_size,
        n_positions=m.seq_length,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_attention_heads,
        n_inner=m.ffn_hidden_size,
        activation_function="gelu_new",  # = tanh GELU
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        layer_norm_epsilon=m.norm_eps,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    cfg.architectures = ["GPT2LMHeadModel"]
    return cfg


def from_hf(cfg, sd: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    return _gpt2_fields(cfg), _gpt2_state(cfg, sd)


def _gpt2_fields(cfg) -> dict:
    if cfg.activation_function not in GELU_TANH:
        raise ValueError(
            f"GPT-2 activation_function={cfg.activation_function!r} is not supported (tanh GELU only)"
        )
    if cfg.scale_attn_by_inverse_layer_idx or not cfg.scale_attn_weights:
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    return dict(
        name="hf_gpt2",
        num_layers=cfg.n_layer,
        hidden_size=cfg.n_embd,
        num_attention_heads=cfg.n_head,
        # n_inner=None means GPT-2's default of 4·D
        num_query_groups=None,
        ffn_hidden_size=cfg.n_inner or 4 * cfg.n_embd,
        seq_length=cfg.n_positions,
        vocab_size=cfg.vocab_size,
        norm="layernorm",
        activation="gelu",
        position_embedding="learned",
        tie_embeddings=bool(cfg.tie_word_embeddings),
        bias=True,
        norm_eps=float(cfg.layer_norm_epsilon),
        dropout=0.0,
    )


def _gpt2_state(cfg, sd: dict) -> dict[str, torch.Tensor]:
    out = {mine: sd[theirs] for mine, theirs in GPT2_TOP.items() if mine != "head.weight"}
    if not cfg.tie_word_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        for rest, theirs in GPT2_LAYER.items():
            t = sd[f"transformer.h.{i}.{theirs}"]
            out[f"layers.{i}.{rest}"] = t.t().contiguous() if t.ndim == 2 else t
    return out
