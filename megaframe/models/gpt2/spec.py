"""GPT-2 (LayerNorm, tanh GELU, learned positions, biases, tied embeddings; no GQA)."""

from megaframe.models.spec import FamilySpec, adapter, requires


def check(m) -> list[str]:
    """GPT-2's block: LayerNorm, tanh GELU, learned positions, every head its own k/v of width
    hidden/heads, a dense MLP, no q/k norms; biases optional (exported as zeros when off), tying too."""
    why = requires(
        "gpt2",
        m,
        norm="layernorm",
        activation="gelu",
        position_embedding="learned",
        num_experts=0,
        qk_norm=False,
    )
    if m.kv_heads != m.num_attention_heads:
        why.append(f"model.num_query_groups={m.num_query_groups} (gpt2 requires null: no GQA)")
    if m.kv_channels not in (None, m.hidden_size // m.num_attention_heads):
        why.append(f"model.kv_channels={m.kv_channels} (gpt2 requires null: head dim = hidden / heads)")
    return why


SPEC = FamilySpec(
    name="gpt2",
    presets=("gpt2_tiny", "gpt2_small"),
    check=check,
    to_hf=adapter("megaframe.models.gpt2.hf", "to_hf"),
    from_hf=adapter("megaframe.models.gpt2.hf", "from_hf"),
    hf_model_type="gpt2",
    hf_architecture="GPT2LMHeadModel",
)
