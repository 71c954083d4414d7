"""Qwen3-MoE <-> megaframe: Qwen3's attention (models/qwen3/hf.py: Llama's layout plus the per-head q/k
RMSNorms) and, in every layer, a softmax top-k MoE of SwiGLU experts whose k weights are renormalised to
sum 1 (transformers' norm_topk_prob=true, what megaframe's router computes).

megaframe, per layer i (E experts, F expert width, D hidden):
    layers.{i}.mlp.router.weight              [E, D]       = model.layers.{i}.mlp.gate.weight
    layers.{i}.mlp.experts.up_proj.weight     [E, 2F, D]   rows [gate | up] per expert
    layers.{i}.mlp.experts.down_proj.weight   [E, D, F]
transformers >= 5 (Qwen3MoeExperts, fused): mlp.experts.gate_up_proj [E, 2F, D] (gate first) and
    mlp.experts.down_proj [E, D, F], as megaframe stores them; transformers 4 (and the published
    safetensors): mlp.experts.{e}.gate_proj / up_proj [F, D], down_proj [D, F].

What megaframe's qwen3_moe does not compute is refused at import in one line: a dense layer among the
experts (decoder_sparse_step != 1, mlp_only_layers), norm_topk_prob=false (the chosen probabilities
unrenormalised; every released Qwen3-MoE sets true), attention biases, sliding windows.

router_aux_loss_coef is model.moe_aux_loss_coeff one to one (as Mixtral's and Megatron-Bridge's mapping):
both scale a Switch-style balance loss, but transformers computes one over all layers' tokens with
f_e = count_e / tokens (K times megaframe's count_e / (tokens x K)), megaframe one per layer, summed.
"""

from __future__ import annotations

import torch

from megaframe.config.schema import ModelConfig
from megaframe.models.hf_rope import rope_config
from megaframe.models.llama import hf as llama
from megaframe.models.mixtral.hf import fused
from megaframe.models.mixtral.hf import unexportable as mixtral_unexportable
from megaframe.models.qwen3.hf import QK_NORMS

MOE = ("mlp.router.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")
FUSED = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.up_proj.weight": "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj.weight": "mlp.experts.down_proj",
}


def experts_out(i: int, rest: str, t: torch.Tensor, stacked: bool) -> dict[str, torch.Tensor]:
    """transformers' tensors of megaframe's layers.{i}.{rest} (one of MOE): renamed when transformers
    stacks the experts too (`stacked`), else one gate/up/down triple per expert."""
    pre = f"model.layers.{i}."
    if stacked or rest == "mlp.router.weight":
        return {pre + FUSED[rest]: t.contiguous()}
    out = {}
    for e, w in enumerate(t.unbind(0)):
        ex = f"{pre}mlp.experts.{e}."
        if rest == "mlp.experts.up_proj.weight":
            gate, up = w.chunk(2, dim=0)  # rows [gate | up]
            out[ex + "gate_proj.weight"], out[ex + "up_proj.weight"] = gate.contiguous(), up.contiguous()
        else:
            out[ex + "down_proj.weight"] = w.contiguous()
    return out


def experts_in(cfg, sd: dict, i: int) -> dict[str, torch.Tensor]:
    """megaframe's MoE tensors of layer i from either transformers layout."""
    pre, mine = f"model.layers.{i}.", f"layers.{i}."
    if pre + FUSED["mlp.experts.up_proj.weight"] in sd:
        return {mine + ours: sd[pre + theirs] for ours, theirs in FUSED.items()}
    ex = [f"{pre}mlp.experts.{e}." for e in range(cfg.num_experts)]
    return {
        mine + "mlp.router.weight": sd[pre + "mlp.gate.weight"],
        mine + "mlp.experts.up_proj.weight": torch.stack(
            [torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]]) for x in ex]
        ),
        mine + "mlp.experts.down_proj.weight": torch.stack([sd[x + "down_proj.weight"] for x in ex]),
    }


def unexportable(m: ModelConfig) -> list[str]:
    """What Qwen3MoeForCausalLM does not compute: the same routing limits as Mixtral's (softmax over the plain
    scores, no token dropped)."""
    return mixtral_unexportable(m, "Qwen3MoeForCausalLM")


def to_hf(m: ModelConfig, state: dict, eos=None, bos=None):
    from transformers import Qwen3MoeConfig

    why = unexportable(m)
    if why:
        raise ValueError(f"{m.name} does not export to Qwen3MoeForCausalLM: {'; '.join(why)}")
    kw = dict(
        llama.common_kw(m, eos, bos),
        moe_intermediate_size=m.expert_ffn,
        num_experts=m.num_experts,
        num_experts_per_tok=m.moe_top_k,
        norm_topk_prob=True,  # megaframe's router renormalises the chosen k
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=m.moe_aux_loss_coeff,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=m.num_layers,
    )
    stacked, sd = fused(), {}
    for name, t in state.items():
        t, split = t.detach().cpu(), llama.split_layer_key(name)
        if split is None:
            if name not in llama.LLAMA_TOP:
                raise ValueError(f"unexpected megaframe tensor {name!r} for a qwen3_moe export")
            sd[llama.LLAMA_TOP[name]] = t
        elif split[1] == "mlp.router.expert_bias":
            continue  # a selection-only buffer, unused (zero) when model.moe_expert_bias is off
        elif split[1] in MOE:
            sd.update(experts_out(*split, t, stacked))
        else:
            sd.update(llama.layer_out(m, *split, t, QK_NORMS))
    return rope_config(Qwen3MoeConfig, kw, m.rope_theta, m.rope_scaling, "Qwen3MoeForCausalLM"), sd


def refusals(cfg) -> list[str]:
    """What a transformers Qwen3MoeConfig holds that megaframe's qwen3_moe does not compute."""
    why = []
    if cfg.num_experts < 1:
        why.append(f"num_experts={cfg.num_experts} (a dense Qwen3: import it as model_type qwen3)")
    dense = list(cfg.mlp_only_layers or [])
    if cfg.decoder_sparse_step != 1 or dense:
        why.append(
            f"decoder_sparse_step={cfg.decoder_sparse_step}, mlp_only_layers={dense}"
            " (megaframe's qwen3_moe makes every layer MoE: step 1, none dense)"
        )
    if not cfg.norm_topk_prob:
        why.append("norm_topk_prob=false (megaframe's router renormalises the top-k weights to sum 1)")
    if getattr(cfg, "attention_bias", False):
        why.append("attention_bias=true (megaframe's `bias` covers the MLP too)")
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        why.append(f"sliding_window={cfg.sliding_window} (megaframe attends to the whole sequence)")
    return why


def from_hf(cfg, sd: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    why = refusals(cfg)
    if why:
        raise ValueError(f"Qwen3-MoE {'; '.join(why)}: not supported")
    fields = dict(
        llama.shape_fields(cfg, "hf_qwen3_moe"),
        bias=False,
        qk_norm=True,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        moe_top_k=cfg.num_experts_per_tok,
        moe_router_score="softmax",
        moe_expert_bias=False,
        moe_capacity_factor=None,
        moe_aux_loss_coeff=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
    )
    return fields, state_in(cfg, sd)


def state_in(cfg, sd: dict) -> dict[str, torch.Tensor]:
    """megaframe full tensors of a Qwen3-MoE state_dict (either transformers layout)."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    names = {**llama.LLAMA_LAYER, **QK_NORMS}
    for i in range(cfg.num_hidden_layers):
        pre, mine = f"model.layers.{i}.", f"layers.{i}."
        out[mine + "attn.qkv.weight"] = torch.cat([sd[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv"])
        # attention and norms by Qwen3's names (the dense MLP's match nothing in a MoE layer)
        out.update({mine + ours: sd[pre + theirs] for ours, theirs in names.items() if pre + theirs in sd})
        out.update(experts_in(cfg, sd, i))
    return out
