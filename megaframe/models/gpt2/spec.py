"""GPT-2 (LayerNorm, tanh GELU, learned positions, biases, tied embeddings; no GQA)."""

from megaframe.models.gpt2 import hf
from megaframe.models.spec import FamilySpec

SPEC = FamilySpec(
    name="gpt2",
    hf_model_type="gpt2",
    hf_architecture="GPT2LMHeadModel",
    presets=("gpt2_tiny", "gpt2_small"),
    mismatch=hf.mismatch,
    to_hf=hf.to_hf,
    from_hf=hf.from_hf,
)
