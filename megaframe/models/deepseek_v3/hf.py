"""DeepSeek-V3 <-> megaframe (transformers' DeepseekV3ForCausalLM; DeepSeek's own checkpoints' names).

Per layer i (megaframe layers.{i}. -> model.layers.{i}.):
    attn_norm / mlp_norm                 input_layernorm / post_attention_layernorm
    attn.q_a_proj, q_norm, q_b_proj      self_attn.q_a_proj, q_a_layernorm, q_b_proj (or q_proj)
    attn.kv_a_proj, kv_norm, kv_b_proj   self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
    attn.out_proj                        self_attn.o_proj
    mlp.up_proj [gate | up], down_proj   mlp.gate_proj, up_proj, down_proj (the dense first layers)
    mlp.router.weight, expert_bias       mlp.gate.weight, mlp.gate.e_score_correction_bias
    mlp.experts.*                        mlp.experts.gate_up_proj / down_proj (transformers >= 5)
    mlp.shared.up_proj, down_proj        mlp.shared_experts.gate_proj, up_proj, down_proj
RoPE: DeepSeek's rows of the R RoPE dims are interleaved pairs (rope_interleave=true); megaframe rotates
halves (mla.py), so those rows of q_b_proj / q_proj (per head) and kv_a_proj (its last R) are permuted
evens-then-odds at import and back at export: exact.
MTP depth k (megaframe mtp.{k}.) is DeepSeek's layer L + k after the last: enorm, hnorm, eh_proj,
shared_head.norm (megaframe's final_norm), the block under the layer names above, and the copies of the
shared embedding and head DeepSeek's files carry (embed_tokens, shared_head.head; read back as the shared
ones). transformers' class computes no MTP: it ignores those layers (checkpoint/hf.py drops them).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megaframe.config.schema import ModelConfig
from megaframe.models.hf_rope import rope_config, rope_from_hf
from megaframe.models.llama.hf import LLAMA_TOP, common_kw
from megaframe.models.mixtral.hf import fused
from megaframe.models.qwen3_moe.hf import MOE, experts_in, experts_out

NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_a_proj.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b_proj.weight": "self_attn.q_b_proj.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.shared.down_proj.weight": "mlp.shared_experts.down_proj.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
GATE_UP = {"mlp.up_proj.weight": "mlp.", "mlp.shared.up_proj.weight": "mlp.shared_experts."}
MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}
MTP["final_norm.weight"] = "shared_head.norm.weight"


def _order(r: int, back: bool) -> torch.Tensor:
    """Rows of the R RoPE dims: DeepSeek's interleaved pairs to halves (evens, then odds), or `back`."""
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    return torch.argsort(perm) if back else perm


def _rope_rows(m: ModelConfig, rest: str, t: torch.Tensor, back: bool) -> torch.Tensor:
    """The RoPE rows of a query or shared-key projection reordered (import: back=False)."""
    r, o = m.qk_rope_head_dim, _order(m.qk_rope_head_dim, back)
    if rest == "attn.kv_a_proj.weight":
        return torch.cat([t[: m.kv_lora_rank], t[m.kv_lora_rank :][o]])
    if rest in ("attn.q_b_proj.weight", "attn.q_proj.weight"):
        w = t.view(m.num_attention_heads, m.qk_nope_head_dim + r, -1)
        return torch.cat([w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :][:, o]], 1).flatten(0, 1)
    return t


def layer_out(m: ModelConfig, i: int, rest: str, t: torch.Tensor, stacked: bool) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{i}."
    t = _rope_rows(m, rest, t, back=True)
    if rest in MOE:
        return experts_out(i, rest, t, stacked)
    if rest in GATE_UP:
        gate, up = t.chunk(2, dim=0)
        return {
            f"{pre}{GATE_UP[rest]}gate_proj.weight": gate.contiguous(),
            f"{pre}{GATE_UP[rest]}up_proj.weight": up.contiguous(),
        }
    if rest not in NAMES:
        raise ValueError(f"unexpected megaframe tensor layers.{i}.{rest} for a deepseek_v3 export")
    return {pre + NAMES[rest]: t.contiguous()}


def unexportable(m: ModelConfig) -> list[str]:
    """What DeepseekV3ForCausalLM does not compute."""
    why = []
    if m.num_experts < 1:
        why.append("model.num_experts=0 (DeepseekV3ForCausalLM makes the blocks after the dense ones MoE)")
    if str(m.moe_router_score) != "sigmoid":
        why.append(f"model.moe_router_score={m.moe_router_score} (DeepseekV3ForCausalLM scores by sigmoid)")
    if m.moe_capacity_factor is not None:
        why.append(f"model.moe_capacity_factor={m.moe_capacity_factor} (transformers drops no token)")
    return why


def config_kw(m: ModelConfig, eos, bos) -> dict:
    """Llama's keywords (common_kw: the family checks make its heads one key and value each, the head
    untied) without head_dim, which DeepseekV3Config sets itself (the RoPE part), plus MLA's and the MoE's."""
    common = {k: v for k, v in common_kw(m, eos, bos).items() if k != "head_dim"}
    return dict(
        common,
        moe_intermediate_size=m.expert_ffn,
        n_shared_experts=m.moe_shared_experts,
        n_routed_experts=m.num_experts,
        num_experts_per_tok=m.moe_top_k,
        routed_scaling_factor=m.moe_routed_scaling_factor,
        n_group=m.moe_n_group,
        topk_group=m.moe_topk_group,
        norm_topk_prob=m.moe_norm_topk_prob,
        first_k_dense_replace=m.moe_dense_layers,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        num_nextn_predict_layers=m.mtp_num_layers,
        rope_interleave=True,
        attention_bias=False,
    )


def to_hf(m: ModelConfig, state: dict, eos=None, bos=None):
    from transformers import DeepseekV3Config

    why = unexportable(m)
    if why:
        raise ValueError(f"{m.name} does not export to DeepseekV3ForCausalLM: {'; '.join(why)}")
    stacked, sd = fused(), {}
    for name, t in state.items():
        t, parts = t.detach().cpu(), name.split(".", 2)
        if parts[0] == "layers":
            sd.update(layer_out(m, int(parts[1]), parts[2], t, stacked))
        elif parts[0] == "mtp":
            sd.update(_mtp_out(m, m.num_layers + int(parts[1]), parts[2], t, stacked))
        elif name in LLAMA_TOP:
            sd[LLAMA_TOP[name]] = t
        else:
            raise ValueError(f"unexpected megaframe tensor {name!r} for a deepseek_v3 export")
    for i in range(m.moe_dense_layers, m.num_layers + m.mtp_num_layers):  # a bias never moved: zeros
        sd.setdefault(f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(m.num_experts))
    for k in range(m.mtp_num_layers):  # the shared tensors' copies DeepSeek's files carry in each depth
        pre = f"model.layers.{m.num_layers + k}."
        sd[pre + "embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        sd[pre + "shared_head.head.weight"] = sd["lm_head.weight"]
    cfg = rope_config(
        DeepseekV3Config, config_kw(m, eos, bos), m.rope_theta, m.rope_scaling, "DeepseekV3ForCausalLM"
    )
    return cfg, sd


def _mtp_out(m: ModelConfig, j: int, rest: str, t: torch.Tensor, stacked: bool) -> dict:
    if rest in MTP:
        return {f"model.layers.{j}.{MTP[rest]}": t.contiguous()}
    return layer_out(m, j, rest.removeprefix("block."), t, stacked)


def refusals(cfg) -> list[str]:
    why = []
    if getattr(cfg, "attention_bias", False):
        why.append("attention_bias=true (megaframe's MLA has no biases)")
    if getattr(cfg, "n_routed_experts", 0) < 1:
        why.append("n_routed_experts=0 (a dense model)")
    return why


def from_hf(cfg, sd: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    why = refusals(cfg)
    if why:
        raise ValueError(f"DeepSeek-V3 {'; '.join(why)}: not supported")
    theta, scaling = rope_from_hf(cfg)
    mtp = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    # the depths the weights hold (transformers' model object drops them: import from its state then has none)
    mtp = mtp if f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in sd else 0
    fields = dict(
        name="hf_deepseek_v3",
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=None,
        kv_channels=None,
        ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=cfg.rms_norm_eps,
        tie_embeddings=False,
        bias=False,
        qk_norm=False,
        rope_theta=theta,
        rope_scaling=scaling,
        num_experts=cfg.n_routed_experts,
        moe_top_k=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_experts=cfg.n_shared_experts or 0,
        moe_n_group=cfg.n_group or 1,
        moe_topk_group=cfg.topk_group or 1,
        moe_norm_topk_prob=bool(cfg.norm_topk_prob),
        moe_routed_scaling_factor=float(cfg.routed_scaling_factor),
        moe_dense_layers=cfg.first_k_dense_replace or 0,
        moe_router_score="sigmoid",
        moe_expert_bias=True,
        moe_capacity_factor=None,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        mtp_num_layers=mtp,
    )
    m = ModelConfig(**{k: v for k, v in fields.items() if k not in ("rope_scaling", "moe_router_score")})
    return fields, state_in(m, cfg, sd, mtp)


def layer_in(m: ModelConfig, cfg, sd: dict, j: int, mine: str) -> dict[str, torch.Tensor]:
    """megaframe's tensors of DeepSeek's layer j under the prefix `mine`."""
    pre, out = f"model.layers.{j}.", {}
    for ours, theirs in NAMES.items():
        if pre + theirs in sd:
            out[mine + ours] = _rope_rows(m, ours, sd[pre + theirs], back=False)
    for ours, theirs in GATE_UP.items():
        if f"{pre}{theirs}gate_proj.weight" in sd:
            out[mine + ours] = torch.cat(
                [sd[f"{pre}{theirs}gate_proj.weight"], sd[f"{pre}{theirs}up_proj.weight"]]
            )
    if pre + "mlp.gate.weight" in sd:
        moe = experts_in(SimpleNamespace(num_experts=cfg.n_routed_experts), sd, j)
        out.update({mine + k.split(".", 2)[2]: v for k, v in moe.items()})
    bias = mine + "mlp.router.expert_bias"
    if bias in out and not out[bias].any():
        del out[bias]  # a zero bias is the buffer's init: the state holds parameters (and a bias in use)
    return out


def state_in(m: ModelConfig, cfg, sd: dict, mtp: int) -> dict[str, torch.Tensor]:
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    out["head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        out.update(layer_in(m, cfg, sd, i, f"layers.{i}."))
    for k in range(mtp):
        j = cfg.num_hidden_layers + k
        out.update({f"mtp.{k}.{ours}": sd[f"model.layers.{j}.{theirs}"] for ours, theirs in MTP.items()})
        out.update(layer_in(m, cfg, sd, j, f"mtp.{k}.block."))
    return out
