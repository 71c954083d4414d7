"""Mixtral's MoE tensors <-> megaframe's (attention, norms and embeddings are Llama's: models/llama/hf.py).

megaframe, per layer i (E experts, F expert width, D hidden):
    layers.{i}.mlp.router.weight              [E, D]
    layers.{i}.mlp.experts.up_proj.weight     [E, 2F, D]   rows [gate | up] per expert
    layers.{i}.mlp.experts.down_proj.weight   [E, D, F]
transformers >= 5 (MixtralExperts, fused): model.layers.{i}.mlp.gate.weight [E, D],
    mlp.experts.gate_up_proj [E, 2F, D] (gate first: `gate, up = linear(x, W).chunk(2)`),
    mlp.experts.down_proj [E, D, F]
transformers 4: model.layers.{i}.block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1 [F, D] (gate),
    w3 [F, D] (up), w2 [D, F] (down).
Routing is the same function on both sides: softmax over E, top-k, the k scores renormalised to sum 1.
"""

from __future__ import annotations

import torch

MIXTRAL_MOE = ("mlp.router.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")


def fused() -> bool:
    """Whether this transformers stores Mixtral's experts as stacked 3-D tensors (version 5 on)."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def experts_out(i: int, rest: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The transformers tensors of megaframe's layers.{i}.{rest} (one of MIXTRAL_MOE)."""
    pre = f"model.layers.{i}."
    # transformers 5 stacks the experts in 3-D tensors, as megaframe stores them: renamed, never split
    if fused():
        name = {
            "mlp.router.weight": "mlp.gate.weight",
            "mlp.experts.up_proj.weight": "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj.weight": "mlp.experts.down_proj",
        }[rest]
        return {pre + name: t.contiguous()}
    moe = pre + "block_sparse_moe."
    if rest == "mlp.router.weight":
        return {moe + "gate.weight": t.contiguous()}
    out = {}
    for e, w in enumerate(t.unbind(0)):
        if rest == "mlp.experts.up_proj.weight":
            gate, up = w.chunk(2, dim=0)  # [gate | up] rows: w1 is the gate, w3 the up
            out[f"{moe}experts.{e}.w1.weight"], out[f"{moe}experts.{e}.w3.weight"] = (
                gate.contiguous(),
                up.contiguous(),
            )
        else:
            out[f"{moe}experts.{e}.w2.weight"] = w.contiguous()
    return out


def mixtral_fields(cfg, rope_theta: float) -> dict:
    """megaframe ModelConfig fields of a transformers MixtralConfig; ValueError for what megaframe lacks."""
    if cfg.hidden_act != "silu":
        raise ValueError(
            f"Mixtral hidden_act={cfg.hidden_act!r} is not supported (megaframe SwiGLU uses silu)"
        )
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < cfg.max_position_embeddings:
        raise ValueError(
            f"Mixtral sliding_window={window} < max_position_embeddings: megaframe attends to the whole "
            "sequence"
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"head_dim={head_dim} x heads != hidden_size={cfg.hidden_size}: not supported")
    return dict(
        name="hf_mixtral",
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        ffn_hidden_size=cfg.intermediate_size,
        moe_ffn_hidden_size=cfg.intermediate_size,
        num_experts=cfg.num_local_experts,
        moe_top_k=cfg.num_experts_per_tok,
        moe_router_score="softmax",
        moe_expert_bias=False,
        moe_capacity_factor=None,
        moe_aux_loss_coeff=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        seq_length=cfg.max_position_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        tie_embeddings=bool(cfg.tie_word_embeddings),
        bias=False,
        rope_theta=rope_theta,
        norm_eps=float(cfg.rms_norm_eps),
        dropout=0.0,
    )


def mixtral_state(cfg, sd: dict) -> dict[str, torch.Tensor]:
    """megaframe full tensors of a Mixtral state_dict (either transformers layout)."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        pre, mine = f"model.layers.{i}.", f"layers.{i}."
        out[f"{mine}attn.qkv.weight"] = torch.cat([sd[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv"])
        out[f"{mine}attn.out_proj.weight"] = sd[f"{pre}self_attn.o_proj.weight"]
        out[f"{mine}attn_norm.weight"] = sd[f"{pre}input_layernorm.weight"]
        out[f"{mine}mlp_norm.weight"] = sd[f"{pre}post_attention_layernorm.weight"]
        if f"{pre}mlp.experts.gate_up_proj" in sd:
            out[f"{mine}mlp.router.weight"] = sd[f"{pre}mlp.gate.weight"]
            out[f"{mine}mlp.experts.up_proj.weight"] = sd[f"{pre}mlp.experts.gate_up_proj"]
            out[f"{mine}mlp.experts.down_proj.weight"] = sd[f"{pre}mlp.experts.down_proj"]
            continue
        moe, e = pre + "block_sparse_moe.", range(cfg.num_local_experts)
        out[f"{mine}mlp.router.weight"] = sd[moe + "gate.weight"]
        out[f"{mine}mlp.experts.up_proj.weight"] = torch.stack(
            [torch.cat([sd[f"{moe}experts.{k}.w1.weight"], sd[f"{moe}experts.{k}.w3.weight"]]) for k in e]
        )
        out[f"{mine}mlp.experts.down_proj.weight"] = torch.stack(
            [sd[f"{moe}experts.{k}.w2.weight"] for k in e]
        )
    return out


def unexportable(m, hf_class: str = "MixtralForCausalLM") -> list[str]:
    """The training options a transformers MoE of Mixtral's routing (`hf_class`: Mixtral's, Qwen3-MoE's) does
    not compute: it routes by a softmax over the plain scores and drops no token."""
    why = []
    if m.moe_router_score != "softmax":
        why.append(f"model.moe_router_score={m.moe_router_score} ({hf_class} routes by softmax)")
    if m.moe_expert_bias:
        why.append(f"model.moe_expert_bias=true ({hf_class} selects by the plain scores)")
    if m.moe_capacity_factor is not None:
        why.append(f"model.moe_capacity_factor={m.moe_capacity_factor} ({hf_class} is dropless)")
    return why


def to_hf(m, state: dict, eos=None, bos=None):
    from transformers import MixtralConfig

    from megaframe.models.hf_rope import rope_config
    from megaframe.models.llama.hf import LLAMA_TOP, common_kw, layer_out, split_layer_key

    why = unexportable(m)
    if why:
        raise ValueError(f"{m.name} does not export to MixtralForCausalLM: {'; '.join(why)}")
    kw = dict(
        common_kw(m, eos, bos),
        intermediate_size=m.expert_ffn,
        num_local_experts=m.num_experts,
        num_experts_per_tok=m.moe_top_k,
        # no jitter, no sliding window: the export must compute
        # exactly what megaframe's router and attention compute
        router_aux_loss_coef=m.moe_aux_loss_coeff,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    sd = {}
    for name, t in state.items():
        t, split = t.detach().cpu(), split_layer_key(name)
        if split is None:
            if name not in LLAMA_TOP:
                raise ValueError(f"unexpected megaframe tensor {name!r} for a mixtral export")
            sd[LLAMA_TOP[name]] = t
        elif split[1] == "mlp.router.expert_bias":
            continue  # a selection-only buffer, unused (zero) when model.moe_expert_bias is off
        elif split[1] in MIXTRAL_MOE:
            sd.update(experts_out(*split, t))
        else:
            sd.update(layer_out(m, *split, t))
    return rope_config(MixtralConfig, kw, m.rope_theta, m.rope_scaling, "MixtralForCausalLM"), sd


def from_hf(cfg, sd: dict):
    from megaframe.models.hf_rope import rope_from_hf

    theta, scaling = rope_from_hf(cfg)
    return dict(mixtral_fields(cfg, theta), rope_scaling=scaling), mixtral_state(cfg, sd)
