"""Llama 2/3.x (RMSNorm, SwiGLU, RoPE with llama3/linear/yarn scaling, GQA, optional biases)."""

from megaframe.models.llama import hf
from megaframe.models.spec import FamilySpec

SPEC = FamilySpec(
    name="llama",
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    presets=("gpt_tiny", "llama_1b", "llama3_8b"),
    mismatch=hf.mismatch,
    to_hf=hf.to_hf,
    from_hf=hf.from_hf,
)
