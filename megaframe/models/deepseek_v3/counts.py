"""DeepSeek-V3's parameter and FLOP counters from its config (the planner's and MFU's), written against
the modules' own parameters (mla.py, block.py, mtp.py); the family conformance test holds them to `numel`
of a meta model.

Legend: D hidden, H heads, N / R / V the no-RoPE, RoPE and value head widths, Q = N + R, Cq / Ckv the
latents, E experts, Fe expert width, Fs shared width (moe_shared_experts x Fe), F dense width, L layers,
M MTP depths, S seq_length, Vo vocab rows.

layer_params is a MoE block's (the planner's uniform layer); a pipeline rank's count (stage_params) takes
each block by its index: the first moe_dense_layers blocks dense, the rest MoE, and the MTP depths (blocks
L, L + 1, ... on the last rank) MoE blocks whose experts split over ep like every other block's.
"""

from __future__ import annotations

from megaframe.config.schema import ModelConfig
from megaframe.models import counts


def _q_out(m: ModelConfig) -> int:
    return m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)


def attention_params(m: ModelConfig, tp: int = 1) -> int:
    """One MLA on one tp rank: the replicated down projections and latent norms, the head-split rest."""
    d, h = m.hidden_size, m.num_attention_heads
    n = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    n += m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) // tp + h * m.v_head_dim * d // tp
    if m.q_lora_rank:
        return n + d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * _q_out(m) // tp
    return n + d * _q_out(m) // tp


def _shared(m: ModelConfig) -> int:
    return m.moe_shared_experts * m.expert_ffn


def moe_layer(m: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) of a DeepSeekMoE block on one rank: MLA, router, shared experts, two norms."""
    d = m.hidden_size
    dense = attention_params(m, tp) + m.num_experts * d + 3 * d * _shared(m) // tp + 2 * d
    return dense, (m.num_experts // ep) * 3 * d * m.expert_ffn


def dense_layer(m: ModelConfig, tp: int = 1) -> int:
    return attention_params(m, tp) + 3 * m.hidden_size * m.ffn_hidden_size // tp + 2 * m.hidden_size


def _dense_layers(m: ModelConfig) -> int:
    return m.num_layers if not m.num_experts else min(m.moe_dense_layers, m.num_layers)


def layer_params(m: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    return moe_layer(m, tp, ep) if m.num_experts else (dense_layer(m, tp), 0)


def block_params(m: ModelConfig, layer: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) of block `layer` (global index; an MTP depth's block is L + its depth) on one rank."""
    return (dense_layer(m, tp), 0) if layer < _dense_layers(m) else layer_params(m, tp, ep)


def stage_params(m: ModelConfig, tp: int, ep: int, layers, first: bool, last: bool) -> tuple[int, int]:
    """(dense, expert) of a pipeline rank holding blocks `layers`: each block by its kind, the shell's
    embedding and head (counts.outside_params), and on the last rank the MTP depths (their norms and
    eh_proj dense, their blocks by kind) with the embedding's copy they read (gpt.py)."""
    dense = expert = 0
    mtp = range(m.num_layers, m.num_layers + m.mtp_num_layers) if last else range(0)
    for i in [*layers, *mtp]:
        d, e = block_params(m, i, tp, ep)
        dense, expert = dense + d, expert + e
    dense += counts.outside_params(m, tp, first, last) + len(mtp) * (3 * m.hidden_size + 2 * m.hidden_size**2)
    if mtp and not first and not m.tie_embeddings:
        dense += m.vocab_size * m.hidden_size // tp
    return dense, expert


def _attention_matmuls(m: ModelConfig) -> int:
    d, h = m.hidden_size, m.num_attention_heads
    q = d * m.q_lora_rank + m.q_lora_rank * _q_out(m) if m.q_lora_rank else d * _q_out(m)
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + h * m.v_head_dim * d


def _moe_matmuls(m: ModelConfig) -> int:
    d = m.hidden_size
    return m.moe_top_k * 3 * d * m.expert_ffn + d * m.num_experts + 3 * d * _shared(m)


def matmul_params(m: ModelConfig) -> int:
    """The matmul weights one token meets: every block's MLA, the dense MLPs or the top_k experts, router
    and shared experts; per MTP depth eh_proj, one block and the head again; the head V x D."""
    dense = _dense_layers(m)
    block = _attention_matmuls(m) + (
        _moe_matmuls(m) if m.num_experts else 3 * m.hidden_size * m.ffn_hidden_size
    )
    n = (
        dense * (_attention_matmuls(m) + 3 * m.hidden_size * m.ffn_hidden_size)
        + (m.num_layers - dense) * block
    )
    mtp = 2 * m.hidden_size * m.hidden_size + block + m.vocab_size * m.hidden_size
    return n + m.mtp_num_layers * mtp + m.vocab_size * m.hidden_size


def flops_per_token(m: ModelConfig, causal: bool = False) -> float:
    """6 N_matmul + the attention core over every block (MTP's too): per token 6 S H (Q + V) (QK^T at
    width Q, PV at V; 12 S H E when both are E), halved with `causal`."""
    q = m.qk_nope_head_dim + m.qk_rope_head_dim
    core = 6 * (m.num_layers + m.mtp_num_layers) * m.seq_length * m.num_attention_heads * (q + m.v_head_dim)
    return 6 * matmul_params(m) + (core / 2 if causal else core)
