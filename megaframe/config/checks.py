"""Cross-field checks of a composed config (megaframe.config.validate runs them): each names the
field at fault in one line, and none needs a process group, so a bad layout is refused before any
rank starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaframe.checkpoint.resume_rules import check_checkpoint_tokenizer, check_resume_setting
from megaframe.config.rules import FIELD_RULES, Rule, _req, check_fields  # noqa: F401  (public API: the one table)
from megaframe.data.config_rules import check_data_fields, check_prepared_folders
from megaframe.errors import ConfigError
from megaframe.models.shape_rules import check_model
from megaframe.parallel.layout_rules import check_layout

if TYPE_CHECKING:
    from megaframe.config.schema import Config


def check_config(cfg: Config, world_size: int, check_data: bool = True, schedules: bool = True) -> None:
    """Cross-field checks that need no process group; the first problem raises ConfigError."""
    check_fields(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    check_layout(p, m, t, world_size)
    dp = world_size // (p.tp * p.pp * p.cp)
    check_model(m, p, dp * p.cp, cfg.optim.shard_group_size)
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
    check_data_fields(cfg.data, t, m)
    from megaframe.runops.access.folders import check_names

    check_names(cfg.run, cfg.checkpoint, cfg.logging)
    check_resume_setting(cfg.checkpoint)
    from megaframe.data.kinds import data_folders

    # a kind reading prepared folders: each whole, fitting the model, of the checkpoint's tokenizer
    if check_data and data_folders(cfg.data):
        check_prepared_folders(cfg.data, m.vocab_size)
        check_checkpoint_tokenizer(cfg.checkpoint, cfg.data)


def _check_allowed_changes(cfg: Config) -> None:
    """checkpoint.allow_config_change names config keys or groups: a typo would allow nothing, silently."""
    if not cfg.checkpoint.allow_config_change:
        return  # nothing named: the schema's keys (a walk of every group) are not needed
    from megaframe.config.keys import schema_keys

    known = schema_keys()
    for name in cfg.checkpoint.allow_config_change:
        _req(
            isinstance(name, str) and name in known,
            f"checkpoint.allow_config_change names {name!r}, "
            "which is not a config key (e.g. train.seed, model)",
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


def _check_overlap(cfg: Config, kind: str) -> None:
    """What a forward running beside another micro-batch's backward (ScheduleSpec.overlap) composes with."""
    from megaframe.pipeline.schedule import SCHEDULES

    if kind not in SCHEDULES or not SCHEDULES[kind].overlap:
        return
    t, o = cfg.train, cfg.optim
    recompute = getattr(t.recompute, "value", t.recompute)
    # the recomputed forward runs inside the backward, where only the chunk's own collectives carry its
    # lane (parallel/lanes.py): its tp/ep/cp collectives could meet the concurrent forward's
    _req(
        recompute == "none",
        f"parallel.pp_schedule={kind} runs a forward beside a backward and does not compose with "
        f"train.recompute={recompute}: use train.recompute=none, or another parallel.pp_schedule",
    )
    # ZeRO-3 gathers each block's params over dp in the forward: the forward and the backward would share
    # the data-parallel communicators, whose collectives are not laned
    _req(
        o.zero < 3,
        f"parallel.pp_schedule={kind} runs a forward beside a backward and does not compose with "
        f"optim.zero={o.zero}: use optim.zero <= 2, or another parallel.pp_schedule",
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
    _check_overlap(cfg, kind)
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
