"""Llama 2/3.x (RMSNorm, SwiGLU, RoPE with llama3/linear/yarn scaling, GQA, optional biases)."""

from megaframe.models.spec import FamilySpec, adapter, requires


def check(m) -> list[str]:
    """Llama's block: RMSNorm, SwiGLU, RoPE, a dense MLP, no q/k norms; GQA, a head dim apart from
    hidden/heads, biases (attention and MLP alike), RoPE scaling and tied embeddings allowed."""
    return requires(
        "llama",
        m,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        num_experts=0,
        qk_norm=False,
    )


SPEC = FamilySpec(
    name="llama",
    presets=("gpt_tiny", "llama_1b", "llama3_8b"),
    check=check,
    to_hf=adapter("megaframe.models.llama.hf", "to_hf"),
    from_hf=adapter("megaframe.models.llama.hf", "from_hf"),
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
)
