"""The model's rules against the layout (config/checks.py runs them, in its order): its family's own
check (models/<family>/spec.py), heads and widths that split evenly over tp, RoPE's pairs and scaling,
and a MoE's experts over ep, etp and the folded data-parallel ranks."""

from __future__ import annotations

from megaframe.config.numeric_rule import _req
from megaframe.config.schema import ModelConfig, ParallelConfig
from megaframe.model.rope_checks import scaling_problem  # beside the formulas, without torch
from megaframe.models.registry import refusal


def check_model(m: ModelConfig, p: ParallelConfig, dpcp: int, shard: int) -> None:
    """The family's rule, then the shapes, then the experts (check_moe's `dpcp` and `shard`)."""
    _req(not (why := refusal(m)), str(why))
    check_shapes(m, p)
    check_moe(m, p, dpcp, shard)


def check_shapes(m: ModelConfig, p: ParallelConfig) -> None:
    """The model's shapes: heads and widths that split evenly over the tp ranks."""
    _req(
        m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
        f"model.hidden_size={m.hidden_size} is not divisible "
        f"by model.num_attention_heads={m.num_attention_heads}",
    )
    _req(
        m.num_attention_heads % m.kv_heads == 0,
        f"model.num_query_groups={m.kv_heads} does not divide "
        f"model.num_attention_heads={m.num_attention_heads}",
    )
    _req(
        m.num_attention_heads % p.tp == 0,
        f"parallel.tp={p.tp} does not divide model.num_attention_heads={m.num_attention_heads}",
    )
    # whole kv heads per tp rank: a rank's query heads must find their kv group locally
    _req(m.kv_heads % p.tp == 0, f"parallel.tp={p.tp} does not divide model.num_query_groups={m.kv_heads}")
    _req(
        m.ffn_hidden_size % p.tp == 0,
        f"parallel.tp={p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}",
    )
    # vocab-parallel embedding and head: each tp rank holds an equal block of rows
    _req(m.vocab_size % p.tp == 0, f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size}")
    # RoPE rotates dim pairs
    _req(m.head_dim % 2 == 0 or m.position_embedding != "rope", "model head dim must be even for RoPE")
    problem = scaling_problem(m.rope_scaling, m.position_embedding)
    _req(problem is None, f"model.rope_scaling: {problem}")
    _req(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    if p.sp:
        # sp splits the sequence evenly over the tp ranks
        _req(
            m.seq_length % p.tp == 0,
            f"parallel.sp needs parallel.tp={p.tp} to divide model.seq_length={m.seq_length}",
        )


def check_moe(m: ModelConfig, p: ParallelConfig, dpcp: int, shard: int) -> None:
    """`dpcp`: cp·dp; the experts fold ep x etp over tp x cp x dp (parallel/rank_grid.py). `shard`:
    optim.shard_group_size (HSDP's replicas must divide the experts' data-parallel size too)."""
    _req(m.num_experts >= 0, f"model.num_experts={m.num_experts} must be >= 0")
    for name in ("ep", "etp"):
        n = getattr(p, name)
        _req(n == 1 or m.num_experts > 0, f"parallel.{name}={n} needs model.num_experts > 0 (a MoE model)")
    stage = p.tp * dpcp
    _req(
        stage % (p.ep * p.etp) == 0,
        f"parallel.ep={p.ep} x parallel.etp={p.etp} = {p.ep * p.etp} must divide tp x cp x dp = "
        f"{p.tp} x {p.cp} x {dpcp // p.cp} = {stage} (experts fold over those ranks)",
    )
    edp = stage // (p.ep * p.etp)
    replicas = dpcp // shard if shard and dpcp % shard == 0 else 1
    _req(
        edp % replicas == 0,
        f"optim.shard_group_size={shard} makes cp x dp / {shard} = {replicas} HSDP replicas, which must "
        f"divide the experts' data-parallel size tp x cp x dp / (ep x etp) = {stage} / {p.ep * p.etp} "
        f"= {edp}",
    )
    if m.num_experts == 0:
        return
    _req(m.num_experts % p.ep == 0, f"parallel.ep={p.ep} does not divide model.num_experts={m.num_experts}")
    f = m.expert_ffn
    _req(
        f % p.etp == 0,
        f"parallel.etp={p.etp} does not divide the experts' width {f} (model.moe_ffn_hidden_size)",
    )
    # every rank routes its own tokens: without sp the tp ranks would route the same ones, and experts
    # split or folded over tp would see them tp-fold
    _req(
        p.tp == 1 or p.sp,
        f"model.num_experts={m.num_experts} with parallel.tp={p.tp} needs parallel.sp=true "
        "(every tp rank must route its own tokens)",
    )
    _req(
        1 <= m.moe_top_k <= m.num_experts,
        f"model.moe_top_k={m.moe_top_k} must be in [1, model.num_experts={m.num_experts}]",
    )
    _req(m.activation == "swiglu", f"model.activation={m.activation!r}: MoE experts are SwiGLU only")
    _req(
        m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1,
        f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} must be >= 1 (or null)",
    )
    _req(
        m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
        f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (or null for dropless)",
    )
    _req(
        m.moe_aux_loss_coeff >= 0 and m.moe_z_loss_coeff >= 0,
        "model.moe_aux_loss_coeff and model.moe_z_loss_coeff must be >= 0",
    )
