"""Mixtral (Llama attention, every block a top-k dropless MoE of SwiGLU experts)."""

from megaframe.models.spec import FamilySpec, adapter, requires


def check(m) -> list[str]:
    """Mixtral's block: Llama's attention, every MLP a mixture of SwiGLU experts, no biases or q/k norms.
    megaframe's router options (sigmoid scores, the expert bias, a capacity) train here; the export
    refuses them (hf.unexportable)."""
    why = requires(
        "mixtral",
        m,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        qk_norm=False,
        bias=False,
    )
    if m.num_experts < 1:
        why.append(f"model.num_experts={m.num_experts} (mixtral requires experts: >= 1)")
    return why


SPEC = FamilySpec(
    name="mixtral",
    presets=("moe_tiny", "mixtral_8x7b"),
    check=check,
    to_hf=adapter("megaframe.models.mixtral.hf", "to_hf"),
    from_hf=adapter("megaframe.models.mixtral.hf", "from_hf"),
    hf_model_type="mixtral",
    hf_architecture="MixtralForCausalLM",
)
