"""Every numeric config field's allowed values, from one table (FIELD_RULES: field -> Rule): range,
finiteness (nan and inf refused everywhere) and type, also for the numbers inside lists. check_config
runs check_fields first, so no later check (or computation) ever sees a nan, an inf or a negative count.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megaframe.errors import ConfigError

if TYPE_CHECKING:
    from megaframe.config.schema import Config


def _req(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(frozen=True)
class Rule:
    """Allowed values of one numeric field: lo <= v (lo < v when lo_open), v < hi (v <= hi when not
    hi_open), always finite; None only when `optional`; `integer` refuses a fraction (and a bool)."""

    lo: float | None = None
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = True
    optional: bool = False
    integer: bool = False
    bound: str = ""
    """Why the upper bound is what it is, said after it (a bound tied to the machine names the machine)."""

    def why(self, v) -> str | None:
        if v is None:
            return None if self.optional else "must be set"
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (self.integer and not float(v).is_integer())
        ):
            return f"must be {'an integer' if self.integer else 'a number'}"
        if not math.isfinite(v):
            return "must be finite"
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return f"must be {'<' if self.hi_open else '<='} {self.hi:g}{self.bound}"
        return None


def _r(lo=None, *, gt=False, hi=None, le=False, opt=False, int_=True, bound="") -> Rule:
    return Rule(lo, gt, hi, not le, opt, int_, bound)


THREADS_PER_CPU = 4
"""train.threads' bound: this many per CPU of the machine that checks the config. Threads past the CPUs
only wait on each other; far past them the OpenMP pool cannot start (train.threads=100000 ended in a
segmentation fault)."""


def max_threads(cpus: int | None = None) -> int:
    return THREADS_PER_CPU * (cpus or os.cpu_count() or 1)


POS, NONNEG = _r(1), _r(0)  # integer counts and sizes
POSF, NONNEGF = _r(0, gt=True, int_=False), _r(0, int_=False)  # finite real numbers
UNIT = _r(0, hi=1, int_=False)  # a fraction in [0, 1)
PART = _r(0, gt=True, hi=1, int_=False)  # a proper part of a whole, in (0, 1)
SHARE = _r(0, gt=True, hi=1, le=True, int_=False)  # a share of a peak, in (0, 1]
SEED = _r(0, hi=2**63)  # numpy and torch take a non-negative int64 seed
# a process-group timeout is a datetime.timedelta
# (at most ~8.6e13 s): a "switch it off" 1e30 overflowed at start
TIMEOUT = _r(0, gt=True, hi=1e9, le=True, int_=False)

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


def field_values(cfg: Config, key: str) -> list[tuple[str, object]]:
    """(name with indices, value) of each value `key` names: one, or one per element where it says `[]`."""
    found = [("", cfg)]
    for part in key.split("."):
        name, many = part.removesuffix("[]"), part.endswith("[]")
        found = [(f"{at}.{name}".lstrip("."), getattr(obj, name)) for at, obj in found]
        if many:
            found = [(f"{at}[{i}]", v) for at, seq in found for i, v in enumerate(seq or ())]
    return found


def check_fields(cfg: Config) -> None:
    """Each numeric field against its FIELD_RULES entry; ConfigError names the first bad one."""
    for key, rule in FIELD_RULES.items():
        try:
            values = field_values(cfg, key)
        except AttributeError:  # a field another branch renamed: the schema test reports it
            continue
        for name, v in values:
            why = rule.why(v)
            _req(why is None, f"{name}={v!r} {why}")


# The tools' own numeric options (evaluate's +batch_size, the planner's +world_size, a device profile's
# figures, generate's --top-p) are checked by the same Rules, each tool holding a table of its options:
# a typed text is parsed here, so "abc", "nan", "-1" and "1e9" are judged alike in every tool.


@dataclass(frozen=True)
class Either:
    """A value any of `rules` allows (lm-eval's limit: a fraction of the documents, or a whole count)."""

    rules: tuple[Rule, ...]
    optional: bool = False

    def why(self, v) -> str | None:
        if v is None and self.optional:
            return None
        reasons = [r.why(v) for r in self.rules]
        return None if None in reasons else f"must be {self.describe()}"

    def describe(self) -> str:
        return " or ".join(describe(r) for r in self.rules)


def describe(rule: Rule | Either) -> str:
    """What a rule allows, as a phrase: `an integer >= 1`, `a finite number > 0 and <= 1`."""
    if isinstance(rule, Either):
        return rule.describe()
    # an integer's bound in full (a seed's 2**63, not 9.22337e+18)
    num = (lambda x: str(int(x))) if rule.integer else (lambda x: f"{x:g}")
    bounds = []
    if rule.lo is not None:
        bounds.append(f"{'>' if rule.lo_open else '>='} {num(rule.lo)}")
    if rule.hi is not None:
        bounds.append(f"{'<' if rule.hi_open else '<='} {num(rule.hi)}")
    kind = "an integer" if rule.integer else "a finite number"
    return " and ".join([f"{kind} {bounds[0]}" if bounds else kind, *bounds[1:]])


def as_number(value) -> int | float | None:
    """A typed option as a number: an int when it reads as one (also `1e3`, a whole float), else a float;
    None when it is not a number at all (`abc`, `auto`, a bool, a list)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    text = str(value).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        return None
    return int(v) if math.isfinite(v) and v.is_integer() and abs(v) < 2**63 else v


def check_option(shown: str, value, rule: Rule | Either):
    """A tool option's value (a number, or the text the user typed) checked by `rule`: the number (an int
    for an integer rule, a float for a real one), or None for an optional one not given. ConfigError
    `<shown> must be <what the rule allows>`, where `shown` is the option as the user typed it
    (`+batch_size=-1`, `--top-p 2`)."""
    if value is None and rule.optional:
        return None
    v = as_number(value)
    if v is None or rule.why(v) is not None:
        raise ConfigError(f"{shown} must be {describe(rule)}")
    if isinstance(rule, Either):  # lm-eval's limit: an int is a count, a float a fraction
        return v
    return int(v) if rule.integer else float(v)


def check_options(given: dict, table: dict[str, Rule | Either], shown) -> dict:
    """Every option of `given` that `table` names, checked (check_option) and parsed; `shown(key, value)`
    is how the tool's user typed it. The other options come back as they were."""
    return {k: check_option(shown(k, v), v, table[k]) if k in table else v for k, v in given.items()}
