"""Qwen3 dense (Llama's block with per-head q/k RMSNorm, GQA, head dim set apart from D/H, RoPE theta 1e6,
tied embeddings in the small models)."""

from megaframe.models.qwen3 import hf
from megaframe.models.spec import FamilySpec

SPEC = FamilySpec(
    name="qwen3",
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    presets=("qwen3_tiny", "qwen3_0_6b"),
    mismatch=hf.mismatch,
    to_hf=hf.to_hf,
    from_hf=hf.from_hf,
)
