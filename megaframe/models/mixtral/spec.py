"""Mixtral (Llama attention, every block a softmax top-k dropless MoE of SwiGLU experts)."""

from megaframe.models.mixtral import hf
from megaframe.models.spec import FamilySpec

SPEC = FamilySpec(
    name="mixtral",
    hf_model_type="mixtral",
    hf_architecture="MixtralForCausalLM",
    presets=("moe_tiny", "mixtral_8x7b"),
    mismatch=hf.mismatch,
    to_hf=hf.to_hf,
    from_hf=hf.from_hf,
)
