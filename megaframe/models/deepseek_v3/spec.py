"""DeepSeek-V3 (and V2-Lite's shape): multi-head latent attention, the first blocks dense, the rest a
DeepSeekMoE of fine-grained routed experts (sigmoid scores, the aux-loss-free bias, group-limited top-k,
a routed scaling factor) beside shared experts, and multi-token prediction depths on the last stage."""

from megaframe.models.deepseek_v3 import counts
from megaframe.models.spec import FamilySpec, adapter, requires

OWNS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_shared_experts",
    "moe_n_group",
    "moe_topk_group",
    "moe_norm_topk_prob",
    "moe_routed_scaling_factor",
    "moe_dense_layers",
    "moe_seq_aux_loss_coeff",
    "mtp_num_layers",
    "mtp_loss_weight",
)
"""The model.* fields only this family computes (models/registry.py refuses them elsewhere)."""


def _dims(m) -> list[str]:
    why = [
        f"model.{k}={getattr(m, k)} (deepseek_v3 requires a width >= 1)"
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not getattr(m, k) or getattr(m, k) < 1
    ]
    if m.qk_rope_head_dim and m.qk_rope_head_dim % 2:
        why.append(f"model.qk_rope_head_dim={m.qk_rope_head_dim} (RoPE rotates pairs: even)")
    if m.num_query_groups not in (None, m.num_attention_heads):
        why.append(f"model.num_query_groups={m.num_query_groups} (MLA: one key and value per head)")
    return why


def _routing(m) -> list[str]:
    why = []
    e, g, tg = m.num_experts, m.moe_n_group, m.moe_topk_group
    if g < 1 or e % g:
        why.append(f"model.moe_n_group={g} (must divide model.num_experts={e})")
    elif tg < 1 or tg > g:
        why.append(f"model.moe_topk_group={tg} (between 1 and model.moe_n_group={g})")
    elif m.moe_top_k > tg * (e // g):
        why.append(
            f"model.moe_top_k={m.moe_top_k} (more than the {tg * (e // g)} experts of the kept groups)"
        )
    if m.moe_dense_layers > m.num_layers:
        why.append(f"model.moe_dense_layers={m.moe_dense_layers} (more than model.num_layers={m.num_layers})")
    return why


def check(m) -> list[str]:
    """DeepSeek-V3's block: MLA (kv_lora_rank and the three head widths set), RMSNorm, SwiGLU, RoPE, no
    biases or q/k norms, an untied head; a MoE's groups dividing its experts."""
    why = requires(
        "deepseek_v3",
        m,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        qk_norm=False,
        bias=False,
        tie_embeddings=False,
    )
    why += _dims(m)
    if m.num_experts:
        why += _routing(m)
    if m.mtp_num_layers < 0:
        why.append(f"model.mtp_num_layers={m.mtp_num_layers} (>= 0)")
    return why


def _block(args, layer: int):
    from megaframe.models.deepseek_v3.block import build_block

    return build_block(args, layer)


SPEC = FamilySpec(
    name="deepseek_v3",
    presets=("deepseek_v3_tiny", "deepseek_v2_lite", "deepseek_v3_671b"),
    check=check,
    to_hf=adapter("megaframe.models.deepseek_v3.hf", "to_hf"),
    from_hf=adapter("megaframe.models.deepseek_v3.hf", "from_hf"),
    hf_model_type="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    block=_block,
    layer_params=counts.layer_params,
    stage_params=counts.stage_params,
    flops_per_token=counts.flops_per_token,
    matmul_params=counts.matmul_params,
    owns=OWNS,
)
