"""The model group of the config schema (model.*): the block's shape, its attention and MoE, RoPE scaling.
Split from megaframe/config/schema.py (which re-exports it) so each file stays a readable size; a leaf
module like it (of megaframe it imports only config/choices.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megaframe.config.choices import (
    Activation,
    Norm,
    PositionEmbedding,
    RopeType,
    RouterScore,
)
from megaframe.config.frozen import Frozen


@dataclass
class RopeScalingConfig(Frozen):
    """RoPE frequency scaling as Hugging Face defines it (transformers' `rope_scaling` / `rope_parameters`):
    the inverse frequencies change, positions stay integers. Imported from and exported to HF configs."""

    rope_type: RopeType = RopeType.default
    """default (plain RoPE) | linear (every frequency / factor) | llama3 (Llama 3.1: low frequencies / factor,
    high kept, a smooth ramp between) | yarn (YaRN's ramp by rotations, cos/sin times attention_factor)."""
    factor: float = 1.0
    """Context extension factor (linear, llama3, yarn)."""
    low_freq_factor: float = 1.0  # Llama 3.1's value
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0  # Llama 3.1's value
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: Optional[int] = None
    """The context the model was pretrained with (llama3, yarn: required)."""
    beta_fast: float = 32.0  # the YaRN paper's value
    """yarn: rotations at which frequencies start being kept."""
    beta_slow: float = 1.0  # the YaRN paper's value
    """yarn: rotations below which frequencies are fully interpolated."""
    attention_factor: Optional[float] = None
    """yarn: cos/sin scale; None = 0.1 * ln(factor) + 1 (the paper's), or from mscale/mscale_all_dim."""
    mscale: Optional[float] = None
    """yarn (DeepSeek): attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)."""
    mscale_all_dim: Optional[float] = None
    """yarn (DeepSeek): see mscale."""
    truncate: bool = True
    """yarn: round the correction range to whole dims (transformers' default; gpt-oss sets false)."""


@dataclass
class ModelConfig(Frozen):
    name: str = "gpt_tiny"
    """Preset name, for logs only."""
    family: Optional[str] = None
    """The model family (megaframe/models/registry.py: llama, gpt2, mixtral, qwen3, qwen3_moe, deepseek_v3,
    custom): it builds the blocks, says which of the fields below a config of it may set (a config it
    refuses exits 2 naming each field), exports and counts. Every preset sets it; None = inferred at load
    from the other fields (the first family that accepts them, custom last: configs and checkpoints from
    before the key)."""
    num_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 128
    """Model width D."""
    num_attention_heads: int = 4
    """Query heads; must divide by parallel.tp."""
    num_query_groups: Optional[int] = None
    """Key/value heads for GQA; None means num_attention_heads (plain multi-head attention)."""
    ffn_hidden_size: int = 512
    """MLP inner width F (per branch for SwiGLU)."""
    seq_length: int = 128
    """Tokens per sample."""
    vocab_size: Optional[int] = None
    """Rows of the embedding table; >= the tokenizer's vocabulary, divisible by parallel.tp. None = the
    prepared data's vocabulary (data.path's meta.json, else data.vocab_size), padded up to a multiple of
    megaframe.config.keys.VOCAB_PAD (the same for every layout, so layouts stay comparable)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 means a dense MLP."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of each expert's SwiGLU (per branch); None means ffn_hidden_size."""
    moe_router_score: RouterScore = RouterScore.softmax
    """softmax | sigmoid: how router logits become scores (top-k weights are renormalised to sum 1)."""
    moe_aux_loss_coeff: float = 0.01  # Switch Transformer's value
    """Load-balancing loss (Switch/GShard: E * sum_e f_e * P_e) weight; logged as aux_loss."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss (mean squared logsumexp of the logits) weight; logged as z_loss."""
    moe_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only,
    moved after each step by moe_bias_update_rate towards under-loaded experts (a checkpointed buffer)."""
    moe_bias_update_rate: float = 1e-3  # DeepSeek-V3's update speed
    """Step of the expert-bias update: bias_e += rate * sign(mean load - load_e), then recentred."""
    moe_capacity_factor: Optional[float] = None
    """None = dropless. Else each expert takes at most ceil(factor * tokens * top_k / experts) assignments
    of a micro-batch (first come, in token order); the rest are dropped (moe/layer{i}/dropped_frac)."""
    moe_force_balance: bool = False
    """Throughput benchmarks only: a token at sequence position p goes to experts (p + j·(E // K)) mod E,
    j < K, whatever its scores, so every expert and every ep rank gets the same rows, a token's experts
    spread over the ranks as a trained router's are (Megatron's
    moe_router_force_load_balancing, torchtitan's _debug_force_load_balance). The combine weights are
    still those experts' scores and the router losses still train the gate; the routing means nothing.
    The planner times it at even load (planning/steptime/moe.py's imbalance)."""
    moe_shared_experts: int = 0
    """Shared experts beside the routed ones (DeepSeek): one dense SwiGLU of width moe_shared_experts *
    moe_ffn_hidden_size every token passes through, split over tp; 0 = none (model.family=deepseek_v3)."""
    moe_n_group: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts in this many equal groups; a token picks
    its moe_topk_group best groups (by the sum of each group's two best scores) and its top-k among them."""
    moe_topk_group: int = 1
    """Groups a token may route to under moe_n_group > 1 (DeepSeek-V3's topk_group)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the chosen k scores to sum 1 (false: the raw scores, DeepSeek-V2's default)."""
    moe_routed_scaling_factor: float = 1.0
    """The routed experts' combined output times this (DeepSeek-V3's routed_scaling_factor: 2.5)."""
    moe_dense_layers: int = 0
    """The first this many blocks have a dense MLP of width ffn_hidden_size instead of experts
    (DeepSeek's first_k_dense_replace; model.family=deepseek_v3)."""
    moe_seq_aux_loss_coeff: float = 0.0
    """DeepSeek-V3's sequence-wise balance loss weight (its alpha, 1e-4): the Switch-style loss computed per
    sequence, averaged over the micro-batch's sequences; logged in aux_loss beside moe_aux_loss_coeff's."""
    q_lora_rank: Optional[int] = None
    """MLA (model.family=deepseek_v3): queries through a latent of this width (RMSNormed); None = a plain
    query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: Optional[int] = None
    """MLA: keys and values through one latent of this width (RMSNormed); None = not MLA."""
    qk_nope_head_dim: Optional[int] = None
    """MLA: the per-head query/key part without RoPE."""
    qk_rope_head_dim: Optional[int] = None
    """MLA: the per-head query/key part with RoPE (the key's part shared by every head)."""
    v_head_dim: Optional[int] = None
    """MLA: the per-head value width (apart from the query/key width)."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths (DeepSeek-V3's num_nextn_predict_layers; model.family=deepseek_v3):
    depth k predicts the token k+1 ahead of each position through one more block, the shared embedding and
    head, on the last pipeline stage; trained only, dropped at generation. Logged as mtp_loss."""
    mtp_loss_weight: float = 0.1  # Megatron's mtp_loss_scaling_factor; DeepSeek-V3 used 0.3 then 0.1
    """The objective adds mtp_loss_weight times the mean over the depths of their LM losses."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (0 keeps layouts bit-comparable)."""
    norm: Norm = Norm.rmsnorm
    """rmsnorm | layernorm."""
    activation: Activation = Activation.swiglu
    """swiglu | gelu."""
    position_embedding: PositionEmbedding = PositionEmbedding.rope
    """rope | learned."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    bias: bool = False
    """Biases on linear layers (GPT-2 style)."""
    rope_theta: float = 10000.0  # RoFormer's base, as in Llama 1/2
    """RoPE base."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE frequency scaling (Llama 3.1/3.2, YaRN, linear); rope_type=default is plain RoPE."""
    max_position_embeddings: Optional[int] = None
    """The context the model is made for, written as Hugging Face's max_position_embeddings on export;
    None = seq_length. import_hf records the HF config's, so a RoPE model continued at a shorter
    model.seq_length still exports its own context. Shapes no weight; learned positions need None or
    seq_length (the table has seq_length rows)."""
    kv_channels: Optional[int] = None
    """Head dim E (Megatron's name); None = hidden_size /
    num_attention_heads. Qwen3 sets it (heads * E != D)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key (weights [E], shared by the heads) before RoPE (Qwen3)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    init_std: float = 0.02  # GPT-2's and Megatron's default
    """Std of the normal init; output projections use init_std / sqrt(2 * num_layers)."""

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank set)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The per-head width RoPE rotates: MLA's qk_rope_head_dim, else the whole head."""
        return (self.qk_rope_head_dim or 0) if self.mla else self.head_dim

    @property
    def expert_ffn(self) -> int:
        """Inner width of one expert (moe_ffn_hidden_size, else ffn_hidden_size)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size
