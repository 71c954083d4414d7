"""Cross-field checks of a composed config (megaframe.config.validate runs them): each names the
field at fault in one line, and none needs a process group, so a bad layout is refused before any
rank starts.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megaframe.config import ConfigError, _one_line

if TYPE_CHECKING:
    from megaframe.config import Config, ModelConfig, ParallelConfig


def _req(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def check_config(cfg: Config, world_size: int, check_data: bool = True) -> None:
    """Cross-field checks that need no process group; the first problem raises ConfigError."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("tp", "pp", "vpp", "ep"):
        _req(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be >= 1")
    _req(world_size % (p.tp * p.pp) == 0,
         f"parallel.tp={p.tp} x parallel.pp={p.pp} does not divide the world size {world_size}")
    dp = world_size // (p.tp * p.pp)
    _req(m.hidden_size % m.num_attention_heads == 0,
         f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    _req(m.num_attention_heads % m.kv_heads == 0,
         f"model.num_query_groups={m.kv_heads} does not divide model.num_attention_heads={m.num_attention_heads}")
    _req(m.num_attention_heads % p.tp == 0,
         f"parallel.tp={p.tp} does not divide model.num_attention_heads={m.num_attention_heads}")
    _req(m.kv_heads % p.tp == 0, f"parallel.tp={p.tp} does not divide model.num_query_groups={m.kv_heads}")
    _req(m.ffn_hidden_size % p.tp == 0, f"parallel.tp={p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
    _req(m.vocab_size % p.tp == 0, f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size}")
    _req(m.head_dim % 2 == 0 or m.position_embedding != "rope", "model head dim must be even for RoPE")
    _req(m.norm in ("rmsnorm", "layernorm"), f"model.norm={m.norm!r} must be rmsnorm or layernorm")
    _req(m.activation in ("swiglu", "gelu"), f"model.activation={m.activation!r} must be swiglu or gelu")
    _req(m.position_embedding in ("rope", "learned"),
         f"model.position_embedding={m.position_embedding!r} must be rope or learned")
    _req(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    if p.sp:
        _req(m.seq_length % p.tp == 0, f"parallel.sp needs parallel.tp={p.tp} to divide model.seq_length={m.seq_length}")
    _check_moe(m, p, dp)
    _req(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    _req(t.global_batch_size % (t.micro_batch_size * dp) == 0,
         f"train.global_batch_size={t.global_batch_size} is not divisible by "
         f"train.micro_batch_size={t.micro_batch_size} x dp={dp}")
    _check_pipeline(cfg, dp)
    _req(t.max_steps >= 1, f"train.max_steps={t.max_steps} must be >= 1")
    _req(t.log_interval >= 1, f"train.log_interval={t.log_interval} must be >= 1")
    _req(t.hang_timeout_s >= 0, f"train.hang_timeout_s={t.hang_timeout_s} must be >= 0 (0 = no watchdog)")
    _req(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r} must be auto, cpu or cuda")
    _req(cfg.optim.lr > 0 and cfg.optim.min_lr >= 0, "optim.lr must be > 0 and optim.min_lr >= 0")
    _req(cfg.optim.warmup_steps >= 0, f"optim.warmup_steps={cfg.optim.warmup_steps} must be >= 0")
    _req(cfg.optim.zero in (0, 1, 2, 3), f"optim.zero={cfg.optim.zero} must be 0, 1, 2 or 3")
    _req(cfg.optim.zero != 3 or not t.compile,
         "optim.zero=3 does not yet compose with train.compile: needs train.compile=false")
    s = cfg.optim.shard_group_size
    _req(s >= 0 and (s == 0 or dp % s == 0), f"optim.shard_group_size={s} must divide dp={dp} (0 = dp)")
    _req(s in (0, dp) or (cfg.optim.zero >= 1 and p.ep == 1),
         f"optim.shard_group_size={s} (HSDP) needs optim.zero >= 1 and parallel.ep=1")
    _req(cfg.optim.bucket_size_mb > 0, f"optim.bucket_size_mb={cfg.optim.bucket_size_mb} must be > 0")
    _req(t.recompute in ("none", "selective", "full"),
         f"train.recompute={t.recompute!r} must be none, selective or full")
    _req(t.precision in ("fp32", "bf16"), f"train.precision={t.precision!r} must be fp32 or bf16")
    _req(t.precision == "fp32" or cfg.optim.zero >= 1,
         f"train.precision={t.precision} needs optim.zero >= 1 (its fp32 master weights live in the ZeRO optimizer)")
    _req(cfg.logging.wandb.mode in ("online", "offline", "disabled"),
         f"logging.wandb.mode={cfg.logging.wandb.mode!r} must be online, offline or disabled")
    _req(cfg.data.kind in ("prepared", "synthetic"), f"data.kind={cfg.data.kind!r} must be prepared or synthetic")
    _check_data_fields(cfg)
    r = cfg.checkpoint.resume
    _req(r in ("auto", "none") or (Path(r) / "metadata.json").is_file(),
         f"checkpoint.resume={r}: not a committed checkpoint folder (no metadata.json)")
    if r not in ("auto", "none"):
        from megaframe.checkpoint.sharded import verify
        try:
            verify(r)
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume={r}: {e}") from e
    if check_data and cfg.data.kind == "prepared":
        _check_prepared(cfg)


def _check_moe(m: ModelConfig, p: ParallelConfig, dp: int) -> None:
    _req(m.num_experts >= 0, f"model.num_experts={m.num_experts} must be >= 0")
    _req(p.ep == 1 or m.num_experts > 0, f"parallel.ep={p.ep} needs model.num_experts > 0 (a MoE model)")
    _req(dp % p.ep == 0, f"parallel.ep={p.ep} does not divide the data-parallel size {dp} (ep ranks come from dp)")
    if m.num_experts == 0:
        return
    _req(m.num_experts % p.ep == 0, f"parallel.ep={p.ep} does not divide model.num_experts={m.num_experts}")
    _req(1 <= m.moe_top_k <= m.num_experts,
         f"model.moe_top_k={m.moe_top_k} must be in [1, model.num_experts={m.num_experts}]")
    _req(m.activation == "swiglu", f"model.activation={m.activation!r}: MoE experts are SwiGLU only")
    _req(m.moe_router_score in ("softmax", "sigmoid"),
         f"model.moe_router_score={m.moe_router_score!r} must be softmax or sigmoid")
    _req(m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1,
         f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} must be >= 1 (or null)")
    _req(m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
         f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (or null for dropless)")
    _req(m.moe_aux_loss_coeff >= 0 and m.moe_z_loss_coeff >= 0,
         "model.moe_aux_loss_coeff and model.moe_z_loss_coeff must be >= 0")


def _check_pipeline(cfg: Config, dp: int) -> None:
    from megaframe.pipeline.partition import stage_counts
    from megaframe.pipeline.schedule import check_args, resolve_kind

    p, t = cfg.parallel, cfg.train
    _req(p.vpp == 1 or p.pp > 1, f"parallel.vpp={p.vpp} needs parallel.pp > 1")
    _req(p.pp_schedule in ("auto", "gpipe", "1f1b", "interleaved"),
         f"parallel.pp_schedule={p.pp_schedule!r} must be auto, gpipe, 1f1b or interleaved")
    try:
        stage_counts(cfg.model.num_layers, p.pp, p.vpp, p.pp_layout)
        check_args(resolve_kind(p.pp_schedule, p.vpp), p.pp, p.vpp, t.global_batch_size // (t.micro_batch_size * dp))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _check_data_fields(cfg: Config) -> None:
    d, t = cfg.data, cfg.train
    _req(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0 (0 = every core)")
    _req(d.tokenizer_sample_bytes >= 0, f"data.tokenizer_sample_bytes={d.tokenizer_sample_bytes} must be >= 0")
    _req(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    for i, b in enumerate(d.blend):
        _req(bool(b.path) and b.weight > 0, f"data.blend[{i}] needs a path and a weight > 0")
    _req(t.eval_interval >= 0 and t.eval_iters >= 1,
         f"train.eval_interval={t.eval_interval} must be >= 0 and train.eval_iters={t.eval_iters} >= 1")
    _req(t.eval_interval == 0 or d.kind == "synthetic" or d.valid_fraction > 0,
         f"train.eval_interval={t.eval_interval} needs a validation split: set data.valid_fraction > 0")


def _check_prepared(cfg: Config) -> None:
    """Every prepared dataset (data.path, or each data.blend path) is whole and fits the model."""
    from megaframe.data.shards import check_datasets

    try:
        check_datasets(cfg)
    except ValueError as e:
        raise ConfigError(_one_line(e)) from e
