"""Llama <-> megaframe (checkpoint/hf.py's module docstring has the megaframe names and layouts).

q_proj/k_proj/v_proj are the [q | k | v] row blocks of attn.qkv as they are (both use rotate-half RoPE on
head-major rows, so no permutation); gate_proj/up_proj the [gate | up] blocks of mlp.up_proj. RoPE base and
scaling (Llama 3.1/3.2's llama3, linear, yarn) travel as transformers' rope_parameters (models/hf_rope.py).
Qwen3 (models/qwen3/hf.py) is this layout plus the q/k norms.
"""

from __future__ import annotations

import torch

from megaframe.config.schema import ModelConfig
from megaframe.models.hf_rope import rope_config, rope_from_hf

LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "attn.out_proj.bias": "self_attn.o_proj.bias",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.down_proj.bias": "mlp.down_proj.bias",
}
LLAMA_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def split_layer_key(name: str) -> tuple[int, str] | None:
    if not name.startswith("layers."):
        return None
    _, i, rest = name.split(".", 2)
    return int(i), rest


def layer_out(m: ModelConfig, i: int, rest: str, t: torch.Tensor, extra: dict | None = None) -> dict:
    """HF tensors of megaframe's layers.{i}.{rest}; `extra` maps more per-layer names (Qwen3's norms)."""
    pre = f"model.layers.{i}."
    e = m.head_dim
    if rest.startswith("attn.qkv."):
        q, k, v = t.split([m.num_attention_heads * e, m.kv_heads * e, m.kv_heads * e], dim=0)
        kind = rest.rsplit(".", 1)[1]
        return {f"{pre}self_attn.{p}_proj.{kind}": x.contiguous() for p, x in zip("qkv", (q, k, v))}
    if rest.startswith("mlp.up_proj."):
        gate, up = t.chunk(2, dim=0)
        kind = rest.rsplit(".", 1)[1]
        return {f"{pre}mlp.gate_proj.{kind}": gate.contiguous(), f"{pre}mlp.up_proj.{kind}": up.contiguous()}
    names = {**LLAMA_LAYER, **(extra or {})}
    if rest not in names:
        raise ValueError(f"unexpected megaframe tensor layers.{i}.{rest} for a {m.name} export")
    return {pre + names[rest]: t}


def state_out(m: ModelConfig, state: dict, extra: dict | None = None) -> dict[str, torch.Tensor]:
    sd = {}
    for name, t in state.items():
        t = t.detach().cpu()
        split = split_layer_key(name)
        if split is not None:
            sd.update(layer_out(m, *split, t, extra))
        elif name in LLAMA_TOP:
            sd[LLAMA_TOP[name]] = t
        else:
            raise ValueError(f"unexpected megaframe tensor {name!r} for a {m.name} export")
    return sd


def common_kw(m: ModelConfig, eos, bos) -> dict:
    """The config keywords Llama, Qwen3 and Mixtral share."""
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        hidden_act="silu",
        # the model's own context (recorded at import), not the length a continued run trained at
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attention_dropout=m.dropout,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
        initializer_range=m.init_std,
    )


def to_hf(m: ModelConfig, state: dict, eos=None, bos=None):
    from transformers import LlamaConfig

    kw = dict(common_kw(m, eos, bos), attention_bias=m.bias, mlp_bias=m.bias)
    return rope_config(LlamaConfig, kw, m.rope_theta, m.rope_scaling, "LlamaForCausalLM"), state_out(m, state)


def shape_fields(cfg, name: str) -> dict:
    """The ModelConfig fields of a Llama-shaped transformers config (Llama, Qwen3)."""
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (megaframe SwiGLU uses silu)")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta, scaling = rope_from_hf(cfg)
    return dict(
        name=name,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        # None when E = D / H: the field stays unset as in the presets
        kv_channels=None if head_dim * cfg.num_attention_heads == cfg.hidden_size else head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        seq_length=cfg.max_position_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        tie_embeddings=bool(cfg.tie_word_embeddings),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.rms_norm_eps),
        dropout=0.0,
    )


def from_hf(cfg, sd: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    if bool(getattr(cfg, "attention_bias", False)) != bool(getattr(cfg, "mlp_bias", False)):
        raise ValueError(
            "Llama with attention_bias != mlp_bias is not supported (megaframe has one `bias` flag)"
        )
    fields = dict(shape_fields(cfg, "hf_llama"), bias=bool(getattr(cfg, "attention_bias", False)))
    return fields, state_in(cfg, sd, bool(getattr(cfg, "attention_bias", False)))


def state_in(cfg, sd: dict, bias: bool, extra: dict | None = None) -> dict[str, torch.Tensor]:
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    kinds = ("weight", "bias") if bias else ("weight",)
    for i in range(cfg.num_hidden_layers):
        pre, mine = f"model.layers.{i}.", f"layers.{i}."
        for kind in kinds:
            out[f"{mine}attn.qkv.{kind}"] = torch.cat([sd[f"{pre}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            out[f"{mine}mlp.up_proj.{kind}"] = torch.cat(
                [sd[f"{pre}mlp.{p}_proj.{kind}"] for p in ("gate", "up")]
            )
        for rest, theirs in {**LLAMA_LAYER, **(extra or {})}.items():
            if pre + theirs in sd:
                out[mine + rest] = sd[pre + theirs]
    return out
