"""Parameter and FLOP counts of the shared transformer (megaframe/model/gpt.py) from its config alone.

Every family builds the same GPT module configured by ModelConfig, so one set of formulas, written against
the modules' own parameters, serves them all; a family spec (models/spec.py) may substitute its own. The
planner (planning/candidate.py) and MFU (training/metrics.py) read them through the family spec;
tests/unit/models/test_model_families.py checks the counts against `sum(p.numel())` of a meta model for every
preset in conf/model/ and for tp/pp cuts.

Legend: D hidden, H query heads, K kv heads, E head dim, F ffn width, V vocab rows, S seq_length.
"""

from __future__ import annotations

from megaframe.config.schema import ModelConfig


def _norm(m: ModelConfig, dim: int) -> int:
    return dim * (2 if m.norm == "layernorm" else 1)


def attention_params(m: ModelConfig, tp: int = 1) -> int:
    """One block's attention on one tp rank: qkv and out projections (weights split by heads), their biases
    (qkv's split, out's replicated), the q/k norms (replicated [E] each)."""
    d, h, k, e = m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_dim
    n = (d * (h + 2 * k) * e + h * e * d) // tp
    if m.bias:
        n += (h + 2 * k) * e // tp + d
    if m.qk_norm:
        n += 2 * e
    return n


def mlp_params(m: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one block's MLP on one rank: a dense MLP split over tp, or a MoE's
    router (replicated) and its experts (split over ep)."""
    d, per = m.hidden_size, (2 if m.activation == "swiglu" else 1)
    if m.num_experts:
        return m.num_experts * d, (m.num_experts // ep) * 3 * d * m.expert_ffn  # experts are SwiGLU only
    f = m.ffn_hidden_size
    n = (per + 1) * d * f // tp
    if m.bias:
        n += per * f // tp + d
    return n, 0


def layer_params(m: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one block on one rank: attention, MLP, the two pre-norms."""
    dense, expert = mlp_params(m, tp, ep)
    return attention_params(m, tp) + dense + 2 * _norm(m, m.hidden_size), expert


def matrix_params(m: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) elements of one block's hidden matrices on one rank (Placement.hidden_matrix: the
    attention and MLP weights, every expert's; not norms, biases nor the router): an update rule keeping
    other state on them (Muon) is sized by these."""
    d, h, k, e = m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_dim
    attn = (d * (h + 2 * k) * e + h * e * d) // tp
    if m.num_experts:
        return attn, mlp_params(m, tp, ep)[1]
    per = 2 if m.activation == "swiglu" else 1
    return attn + (per + 1) * d * m.ffn_hidden_size // tp, 0


def outside_params(m: ModelConfig, tp: int, first: bool, last: bool) -> int:
    """Parameters outside the blocks on a pipeline rank: the embedding (and learned positions) on the
    first, the final norm and the head on the last (with tied embeddings the last keeps its own copy of
    the table unless it is also the first)."""
    table = m.vocab_size * m.hidden_size // tp
    n = 0
    if first:
        n += table + (m.seq_length * m.hidden_size if m.position_embedding == "learned" else 0)
    if last:
        n += _norm(m, m.hidden_size) + (table if not (first and m.tie_embeddings) else 0)
    return n


def total_params(m: ModelConfig) -> int:
    """Every parameter of the whole model in one process."""
    return m.num_layers * sum(layer_params(m)) + outside_params(m, 1, True, True)


def matmul_params(m: ModelConfig) -> int:
    """N_matmul of training/metrics.py's MFU formula: the matmul weights one token meets (MoE: only its
    top_k experts, plus the router), plus the output head V * D (tied or not: the logits matmul runs)."""
    d, e, h = m.hidden_size, m.head_dim, m.num_attention_heads
    attn = d * (h + 2 * m.kv_heads) * e + h * e * d
    per_expert = 3 if m.activation == "swiglu" else 2
    if m.num_experts > 0:
        mlp = m.moe_top_k * per_expert * d * m.expert_ffn + d * m.num_experts  # active experts + router
    else:
        mlp = per_expert * d * m.ffn_hidden_size
    return m.num_layers * (attn + mlp) + m.vocab_size * d


def flops_per_token(m: ModelConfig, causal: bool = False) -> float:
    """Model FLOPs per trained token (forward + backward): 6 N_matmul + the attention core's
    12 L S H E (counted full, or halved with `causal`); training/metrics.py's docstring derives it."""
    attn_core = 12 * m.num_layers * m.seq_length * m.num_attention_heads * m.head_dim
    return 6 * matmul_params(m) + (attn_core / 2 if causal else attn_core)
