"""Qwen3-MoE (Qwen3's attention with per-head q/k RMSNorm, GQA and a head dim apart from D/H; every
block's MLP a softmax top-k mixture of fine-grained SwiGLU experts, the k weights renormalised; no shared
experts; untied embeddings in the released models)."""

from megaframe.models.spec import FamilySpec, adapter, requires


def check(m) -> list[str]:
    """Qwen3-MoE's block: Qwen3's attention (q and k RMSNormed per head, no biases), every MLP a mixture
    of SwiGLU experts. megaframe's router options (sigmoid scores, the expert bias, a capacity) train
    here; the export refuses them (hf.unexportable)."""
    why = requires(
        "qwen3_moe",
        m,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        qk_norm=True,
        bias=False,
    )
    if m.num_experts < 1:
        why.append(f"model.num_experts={m.num_experts} (qwen3_moe requires experts: >= 1)")
    return why


SPEC = FamilySpec(
    name="qwen3_moe",
    presets=("qwen3_moe_tiny", "qwen3_30b_a3b", "qwen3_235b_a22b"),
    check=check,
    to_hf=adapter("megaframe.models.qwen3_moe.hf", "to_hf"),
    from_hf=adapter("megaframe.models.qwen3_moe.hf", "from_hf"),
    hf_model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
)
