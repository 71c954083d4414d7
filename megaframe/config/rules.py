"""Every numeric config field's allowed values, from one table (FIELD_RULES: field -> Rule): range,
finiteness (nan and inf refused everywhere) and type, also for the numbers inside lists. check_config
runs check_fields first, so no later check (or computation) ever sees a nan, an inf or a negative count.
"""

from __future__ import annotations

import functools
import operator
import os
from typing import TYPE_CHECKING

from megaframe.config.numeric_rule import (  # noqa: F401  (re-exported: the tools' tables import them here)
    NONNEG,
    NONNEGF,
    PART,
    POS,
    POSF,
    SEED,
    SHARE,
    TIMEOUT,
    UNIT,
    Either,
    Rule,
    _r,
    _req,
    as_number,
    check_option,
    check_options,
    describe,
)

if TYPE_CHECKING:
    from megaframe.config.schema import Config


THREADS_PER_CPU = 4
"""train.threads' bound: this many per CPU of the machine that checks the config. Threads past the CPUs
only wait on each other; far past them the OpenMP pool cannot start (train.threads=100000 ended in a
segmentation fault)."""


def max_threads(cpus: int | None = None) -> int:
    return THREADS_PER_CPU * (cpus or os.cpu_count() or 1)


FIELD_RULES: dict[str, Rule] = {
    # model
    "model.num_layers": POS,
    "model.hidden_size": POS,
    "model.num_attention_heads": POS,
    "model.num_query_groups": _r(1, opt=True),
    "model.ffn_hidden_size": POS,
    "model.seq_length": POS,
    "model.vocab_size": POS,
    "model.num_experts": NONNEG,
    "model.moe_top_k": POS,
    "model.moe_ffn_hidden_size": _r(1, opt=True),
    "model.moe_aux_loss_coeff": NONNEGF,
    "model.moe_z_loss_coeff": NONNEGF,
    "model.moe_bias_update_rate": NONNEGF,
    "model.moe_capacity_factor": _r(0, gt=True, opt=True, int_=False),
    "model.dropout": UNIT,
    "model.rope_theta": POSF,
    "model.norm_eps": POSF,
    "model.init_std": POSF,
    "model.kv_channels": _r(1, opt=True),
    "model.q_lora_rank": _r(1, opt=True),
    "model.kv_lora_rank": _r(1, opt=True),
    "model.qk_nope_head_dim": _r(1, opt=True),
    "model.qk_rope_head_dim": _r(1, opt=True),
    "model.v_head_dim": _r(1, opt=True),
    "model.moe_shared_experts": NONNEG,
    "model.moe_n_group": POS,
    "model.moe_topk_group": POS,
    "model.moe_routed_scaling_factor": POSF,
    "model.moe_dense_layers": NONNEG,
    "model.moe_seq_aux_loss_coeff": NONNEGF,
    "model.mtp_num_layers": NONNEG,
    "model.mtp_loss_weight": NONNEGF,
    "model.max_position_embeddings": _r(1, opt=True),
    "model.rope_scaling.factor": POSF,
    "model.rope_scaling.low_freq_factor": POSF,
    "model.rope_scaling.high_freq_factor": POSF,
    "model.rope_scaling.original_max_position_embeddings": _r(1, opt=True),
    "model.rope_scaling.beta_fast": POSF,
    "model.rope_scaling.beta_slow": POSF,
    "model.rope_scaling.attention_factor": _r(0, gt=True, opt=True, int_=False),
    "model.rope_scaling.mscale": _r(0, opt=True, int_=False),
    "model.rope_scaling.mscale_all_dim": _r(0, opt=True, int_=False),
    # parallel
    "parallel.tp": POS,
    "parallel.pp": POS,
    "parallel.vpp": POS,
    "parallel.ep": POS,
    "parallel.etp": POS,
    "parallel.ranks_per_node": NONNEG,
    "parallel.cp": POS,
    "parallel.tp_comm_chunks": POS,
    # train
    "train.micro_batch_size": POS,
    "train.global_batch_size": POS,
    "train.max_steps": POS,
    "train.seed": SEED,
    "train.log_interval": POS,
    "train.max_bad_steps": NONNEG,
    "train.eval_interval": NONNEG,
    "train.eval_iters": POS,
    "train.hang_timeout_s": NONNEGF,
    "train.threads": _r(
        1,
        hi=max_threads(),
        le=True,
        opt=True,
        bound=f" ({THREADS_PER_CPU} per CPU of this machine's {os.cpu_count() or 1})",
    ),
    "train.dist_timeout_s": TIMEOUT,
    "train.compile_timeout_s": TIMEOUT,
    "train.signal_check_interval": POS,
    "train.sample_interval": NONNEG,
    "train.sample_tokens": POS,
    "train.downstream_interval": NONNEG,
    "train.downstream_limit": NONNEG,
    "train.downstream_batch_size": POS,
    "train.downstream_harness_timeout_s": TIMEOUT,
    # optim
    "optim.lr": POSF,
    "optim.min_lr": NONNEGF,
    "optim.warmup_steps": NONNEG,
    "optim.weight_decay": NONNEGF,
    "optim.clip_grad": NONNEGF,
    "optim.beta1": UNIT,
    "optim.beta2": UNIT,
    "optim.eps": POSF,
    "optim.zero": _r(0, hi=3, le=True),
    "optim.shard_group_size": NONNEG,
    "optim.bucket_size_mb": POSF,
    "optim.lr_decay_steps": _r(1, opt=True),
    "optim.wsd_decay_fraction": _r(0, gt=True, hi=1, le=True, int_=False),
    "optim.muon.adamw_lr": _r(0, gt=True, opt=True, int_=False),
    "optim.muon.momentum": UNIT,
    # torch's Newton-Schulz refuses 100 steps or more
    "optim.muon.ns_steps": _r(1, hi=100),
    # data
    "data.vocab_size": POS,
    "data.tokenizer_sample_bytes": NONNEG,
    "data.num_workers": NONNEG,
    "data.task": NONNEG,
    "data.num_tasks": POS,
    "data.valid_fraction": UNIT,
    # checkpoint
    "checkpoint.interval": NONNEG,
    "checkpoint.interval_minutes": NONNEGF,
    "checkpoint.keep_last": NONNEG,
    "checkpoint.save_timeout_s": TIMEOUT,
    # the numbers inside lists: `[]` stands for every element
    "parallel.pp_layout[]": NONNEG,
    "train.profile_steps[]": POS,
    "train.memory_snapshot[]": POS,
    "data.blend[].weight": POSF,
    "data.stages[].until_step": _r(1, opt=True),
    "data.stages[].until_tokens": _r(1, opt=True, int_=False),
    "data.stages[].blend[].weight": POSF,
}
"""Every int/float field of the schema must appear here (tests/unit/config/test_config_fields.py checks it),
also one inside a list (`[]`): a new numeric field gets its rule in the same change."""


@functools.lru_cache(maxsize=None)
def _path(key: str) -> tuple[tuple[str, bool], ...]:
    """(attribute, whether it is a list `[]`) per dotted part of a FIELD_RULES key."""
    return tuple((part.removesuffix("[]"), part.endswith("[]")) for part in key.split("."))


def field_values(cfg: Config, key: str) -> list[tuple[str, object]]:
    """(name with indices, value) of each value `key` names: one, or one per element where it says `[]`."""
    found = [("", cfg)]
    for name, many in _path(key):
        found = [(f"{at}.{name}".lstrip("."), getattr(obj, name)) for at, obj in found]
        if many:
            found = [(f"{at}[{i}]", v) for at, seq in found for i, v in enumerate(seq or ())]
    return found


@functools.lru_cache(maxsize=None)
def _getter(key: str):
    """field_values' values without their names, as a function of the config: what check_fields reads for
    every field of every config it checks (the planner's search checks thousands), the names only built
    for a message. A plain dotted key is one C-level attrgetter."""
    if "[]" not in key:
        one = operator.attrgetter(key)
        return lambda cfg: (one(cfg),)

    def values(cfg) -> list:
        found = [cfg]
        for name, many in _path(key):
            found = [getattr(obj, name) for obj in found]
            if many:
                found = [v for seq in found for v in (seq or ())]
        return found

    return values


def check_fields(cfg: Config) -> None:
    """Each numeric field against its FIELD_RULES entry; ConfigError names the first bad one."""
    for key, rule in FIELD_RULES.items():
        try:
            values = _getter(key)(cfg)
        except AttributeError:  # a field another branch renamed: the schema test reports it
            continue
        if all(rule.why(v) is None for v in values):
            continue
        for name, v in field_values(cfg, key):
            why = rule.why(v)
            _req(why is None, f"{name}={v!r} {why}")
