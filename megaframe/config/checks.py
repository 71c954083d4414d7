"""Cross-field checks of a composed config (megaframe.config.validate runs them): each names the
field at fault in one line, and none needs a process group, so a bad layout is refused before any
rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megaframe.config.rules import FIELD_RULES, Rule, _req, check_fields  # noqa: F401  (public API: the one table)
from megaframe.errors import ConfigError

if TYPE_CHECKING:
    from megaframe.config.schema import Config, ModelConfig, ParallelConfig


def check_config(cfg: Config, world_size: int, check_data: bool = True, schedules: bool = True) -> None:
    """Cross-field checks that need no process group; the first problem raises ConfigError."""
    check_fields(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("tp", "pp", "vpp", "ep", "etp"):
        _req(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be >= 1")
    _req(
        not p.tp_comm_overlap or (p.sp and p.tp > 1),
        f"parallel.tp_comm_overlap=true overlaps sp's collectives: it needs parallel.sp=true and tp > 1 "
        f"(got parallel.sp={p.sp}, parallel.tp={p.tp})",
    )
    _req(
        world_size % (p.tp * p.pp) == 0,
        f"parallel.tp={p.tp} x parallel.pp={p.pp} does not divide the world size {world_size}",
    )
    _check_context(cfg, world_size)
    dp = world_size // (p.tp * p.pp * p.cp)
    from megaframe.models.registry import refusal  # the family's own rule (models/<family>/spec.py)

    _req(not (why := refusal(m)), str(why))
    _check_model_shapes(m, p)
    _check_moe(m, p, dp * p.cp, cfg.optim.shard_group_size)
    _req(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    # every dp rank runs the same number of whole micro-batches: ranks must agree on the schedule's length
    _req(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        f"train.global_batch_size={t.global_batch_size} is not divisible by "
        f"train.micro_batch_size={t.micro_batch_size} x dp={dp}",
    )
    _check_pipeline(cfg, dp, schedules)
    _req(t.max_steps >= 1, f"train.max_steps={t.max_steps} must be >= 1")
    _req(t.log_interval >= 1, f"train.log_interval={t.log_interval} must be >= 1")
    _req(t.hang_timeout_s >= 0, f"train.hang_timeout_s={t.hang_timeout_s} must be >= 0 (0 = no watchdog)")
    # below a second the watchdog trips between any two heartbeats (a finished run exited 124, a "hang")
    _req(
        t.hang_timeout_s == 0 or t.hang_timeout_s >= 1,
        f"train.hang_timeout_s={t.hang_timeout_s} must be 0 (no watchdog) or >= 1 (seconds without a step)",
    )
    _check_allowed_changes(cfg)
    _req(t.dist_timeout_s > 0, f"train.dist_timeout_s={t.dist_timeout_s} must be > 0")
    _req(t.compile_timeout_s > 0, f"train.compile_timeout_s={t.compile_timeout_s} must be > 0")
    _req(
        cfg.checkpoint.save_timeout_s > 0,
        f"checkpoint.save_timeout_s={cfg.checkpoint.save_timeout_s} must be > 0",
    )
    _req(t.signal_check_interval >= 1, f"train.signal_check_interval={t.signal_check_interval} must be >= 1")
    _check_optim(cfg, dp)
    from megaframe.config.data_checks import check_checkpoint_tokenizer, check_data_fields, check_prepared

    check_data_fields(cfg)
    from megaframe.runops.access.folders import check_names

    check_names(cfg.run, cfg.checkpoint, cfg.logging)
    _check_resume(cfg)
    from megaframe.data.kinds import data_folders

    # a kind reading prepared folders: each whole, fitting the model, of the checkpoint's tokenizer
    if check_data and data_folders(cfg.data):
        check_prepared(cfg)
        check_checkpoint_tokenizer(cfg)


def _check_allowed_changes(cfg: Config) -> None:
    """checkpoint.allow_config_change names config keys or groups: a typo would allow nothing, silently."""
    from megaframe.config.keys import schema_keys

    known = schema_keys()
    for name in cfg.checkpoint.allow_config_change:
        _req(
            isinstance(name, str) and name in known,
            f"checkpoint.allow_config_change names {name!r}, "
            "which is not a config key (e.g. train.seed, model)",
        )


def _check_model_shapes(m: ModelConfig, p: ParallelConfig) -> None:
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
    from megaframe.model.rope_checks import scaling_problem  # beside the formulas, without torch

    problem = scaling_problem(m.rope_scaling, m.position_embedding)
    _req(problem is None, f"model.rope_scaling: {problem}")
    _req(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    if p.sp:
        # sp splits the sequence evenly over the tp ranks
        _req(
            m.seq_length % p.tp == 0,
            f"parallel.sp needs parallel.tp={p.tp} to divide model.seq_length={m.seq_length}",
        )


def _check_optim(cfg: Config, dp: int) -> None:
    """The update rule, the lr curve, the ZeRO stage, HSDP's shard groups and what low precision needs."""
    p, t = cfg.parallel, cfg.train
    _req(cfg.optim.lr > 0 and cfg.optim.min_lr >= 0, "optim.lr must be > 0 and optim.min_lr >= 0")
    _req(cfg.optim.warmup_steps >= 0, f"optim.warmup_steps={cfg.optim.warmup_steps} must be >= 0")
    _check_lr_schedule(cfg)
    from megaframe.optim.rule_registry import check_rule_name  # the registry of names, without torch

    check_rule_name(cfg.optim.name)
    _req(cfg.optim.zero in (0, 1, 2, 3), f"optim.zero={cfg.optim.zero} must be 0, 1, 2 or 3")
    # HSDP shards over blocks of the cp·dp ranks (params are replicated over cp too: mesh.py)
    s, dpcp = cfg.optim.shard_group_size, dp * p.cp
    ranks = f"cp·dp={dpcp}" if p.cp > 1 else f"dp={dp}"
    _req(
        s >= 0 and (s == 0 or dpcp % s == 0),
        f"optim.shard_group_size={s} must divide {ranks} (0 = all of them)",
    )
    _req(
        s in (0, dpcp) or cfg.optim.zero >= 1,
        f"optim.shard_group_size={s} (HSDP) needs optim.zero >= 1",
    )
    # Muon orthogonalises each expert's whole matrix: an etp slice of it is not one
    _req(
        p.etp == 1 or cfg.optim.name != "muon",
        f"optim.name={cfg.optim.name} with parallel.etp={p.etp}: Muon needs each expert's whole matrix "
        "(use parallel.etp=1)",
    )
    _req(cfg.optim.bucket_size_mb > 0, f"optim.bucket_size_mb={cfg.optim.bucket_size_mb} must be > 0")
    _req(
        t.precision == "fp32" or cfg.optim.zero >= 1,
        f"train.precision={t.precision} needs optim.zero >= 1 "
        "(its fp32 master weights live in the ZeRO optimizer)",
    )
    # Megatron allows --grad-reduce-in-bf16 only with bf16 params: with fp32 params the bf16 grads would be
    # rounded below the precision of the weights they update, for no memory the user asked to save.
    _req(
        cfg.optim.grad_reduce_dtype == "fp32" or t.precision in ("bf16", "fp8"),
        f"optim.grad_reduce_dtype={cfg.optim.grad_reduce_dtype} needs train.precision=bf16 "
        f"(got train.precision={t.precision})",
    )


def _check_resume(cfg: Config) -> None:
    """checkpoint.resume names a committed checkpoint whose metadata is whole."""
    r = cfg.checkpoint.resume
    if r == "auto":  # a checkpoint dir whose live branch cannot be told is refused before any rank starts
        from megaframe.checkpoint.resolve import Unresolved, head

        try:
            head(cfg.checkpoint.dir, warn=lambda msg: None)  # resume warns once, on rank 0
        except Unresolved as e:
            raise ConfigError(f"checkpoint.resume=auto: {e}") from None
    _req(
        r in ("auto", "none") or (Path(r) / "metadata.json").is_file(),
        f"checkpoint.resume={r}: not a committed checkpoint folder (no metadata.json)",
    )
    if r not in ("auto", "none"):  # metadata only: shard bytes are checked where each rank reads them
        from megaframe.checkpoint.metadata import check_complete

        try:
            check_complete(r)
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume={r}: {e}") from e


def _check_context(cfg: Config, world_size: int) -> None:
    """Context parallelism: layouts that divide, and the combinations not built (refused, never wrong)."""
    m, p = cfg.model, cfg.parallel
    _req(p.cp >= 1, f"parallel.cp={p.cp} must be >= 1")
    if p.cp == 1:
        return
    _req(
        world_size % (p.tp * p.pp * p.cp) == 0,
        f"parallel.tp={p.tp} x parallel.cp={p.cp} x parallel.pp={p.pp} "
        f"does not divide the world size {world_size}",
    )
    _req(
        m.seq_length % (2 * p.cp) == 0,
        f"parallel.cp={p.cp} needs model.seq_length={m.seq_length} "
        "divisible by 2·cp (each rank keeps two chunks)",
    )
    _req(
        not p.sp or (m.seq_length // p.cp) % p.tp == 0,
        f"parallel.sp with parallel.cp={p.cp} needs parallel.tp={p.tp} "
        f"to divide seq_length/cp={m.seq_length // p.cp}",
    )
    # the sampler feeds whole sequences to a model whose positions are split over cp: it crashed every rank at
    # the first sample step, after training; refused before any step until it runs under cp
    _req(
        cfg.train.sample_interval == 0,
        f"train.sample_interval={cfg.train.sample_interval} is not built with parallel.cp={p.cp}: set "
        "train.sample_interval=0 (sample after training: python -m megaframe.generate CHECKPOINT_DIR)",
    )
    # scoring reads whole sequences, as the sampler does
    _req(
        cfg.train.downstream_interval == 0,
        f"train.downstream_interval={cfg.train.downstream_interval} "
        f"is not built with parallel.cp={p.cp}: set "
        "train.downstream_interval=0 (score after training: python -m megaframe.evaluate "
        "checkpoint=DIR +tasks=...)",
    )


def _check_lr_schedule(cfg: Config) -> None:
    o = cfg.optim
    _req(
        o.lr_decay_steps is None or o.lr_decay_steps >= 1,
        f"optim.lr_decay_steps={o.lr_decay_steps} must be >= 1 (or null: train.max_steps of the first start)",
    )
    # each alone is in range, together they describe a curve nobody means (Megatron asserts both)
    _req(
        o.min_lr <= o.lr,
        f"optim.min_lr={o.min_lr} must be <= optim.lr={o.lr} (the decay ends at min_lr: lower optim.min_lr)",
    )
    _req(
        o.lr_decay_steps is None or o.lr_decay_steps > o.warmup_steps,
        f"optim.lr_decay_steps={o.lr_decay_steps} must be > optim.warmup_steps={o.warmup_steps} "
        "(the decay horizon counts from step 0, warmup included)",
    )
    _req(
        0.0 < o.wsd_decay_fraction <= 1.0,
        f"optim.wsd_decay_fraction={o.wsd_decay_fraction} must be in (0, 1]",
    )


def _check_moe(m: ModelConfig, p: ParallelConfig, dpcp: int, shard: int) -> None:
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


def _check_pipeline(cfg: Config, dp: int, schedules: bool = True) -> None:
    from megaframe.config.derived import schedule_kind
    from megaframe.pipeline.partition import check_runnable, stage_counts
    from megaframe.pipeline.schedule import splits_backward

    p, t = cfg.parallel, cfg.train
    _req(p.vpp == 1 or p.pp > 1, f"parallel.vpp={p.vpp} needs parallel.pp > 1")
    kind = schedule_kind(p)
    # every kind whose spec splits the backward, registered now or later, by this one rule
    if splits_backward(kind):
        # the split backward re-runs a weighted op's node for W (pipeline/split.py): a compiled block is one
        # node computing every grad, and torchao's float8 GEMM computes both grads at once
        for bad, why in ((t.compile, "train.compile=true"), (t.precision == "fp8", "train.precision=fp8")):
            _req(
                not bad,
                f"parallel.pp_schedule={kind} splits each backward in two and does not compose with {why}",
            )
    try:
        counts = stage_counts(cfg.model.num_layers, p.pp, p.vpp, p.pp_layout)
        # every rank's schedule is built here, as the executor will build it: a layout it cannot run is
        # refused now, not at step 1
        check_runnable(
            kind,
            p.pp,
            p.vpp,
            t.global_batch_size // (t.micro_batch_size * dp),
            moe=cfg.model.num_experts > 0,
            recompute=getattr(t.recompute, "value", t.recompute),
            counts=counts,
            build=schedules,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
