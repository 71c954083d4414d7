"""Qwen3 dense (Llama's block with per-head q/k RMSNorm, GQA, head dim set apart from D/H, RoPE theta 1e6,
tied embeddings in the small models)."""

from megaframe.models.spec import FamilySpec, adapter, requires


def check(m) -> list[str]:
    """Qwen3's block: Llama's with each head's q and k RMSNormed, no biases (its attention_bias would
    bias attention only; megaframe's one flag covers the MLP too), a dense MLP."""
    return requires(
        "qwen3",
        m,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        num_experts=0,
        qk_norm=True,
        bias=False,
    )


SPEC = FamilySpec(
    name="qwen3",
    presets=("qwen3_tiny", "qwen3_0_6b"),
    check=check,
    to_hf=adapter("megaframe.models.qwen3.hf", "to_hf"),
    from_hf=adapter("megaframe.models.qwen3.hf", "from_hf"),
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
)
