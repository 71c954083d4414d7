"""Cross-field checks of the data group and of what a run reads (config/checks.py's check_config runs them):
the blend and stages, the validation and sampling intervals that need data, the prepared folders (the
tokenizer a resumed checkpoint was trained with: checkpoint/resume_rules.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megaframe.config.numeric_rule import _req
from megaframe.errors import ConfigError
from megaframe.errors import one_line as _one_line

if TYPE_CHECKING:
    from megaframe.config.schema import DataConfig, ModelConfig, TrainConfig


def check_data_fields(d: DataConfig, t: TrainConfig, m: ModelConfig) -> None:
    from megaframe.data.kinds import data_kind
    from megaframe.data.record import twice

    _req(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0 (0 = every core)")
    _req(
        d.tokenizer_sample_bytes >= 0, f"data.tokenizer_sample_bytes={d.tokenizer_sample_bytes} must be >= 0"
    )
    _req(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    for i, b in enumerate(d.blend):
        _req(bool(b.path) and b.weight > 0, f"data.blend[{i}] needs a path and a weight > 0")
        # inf (or a sum that overflows) normalises to nan/0: every sample silently from dataset 0
        _req(math.isfinite(b.weight), f"data.blend[{i}].weight={b.weight} must be finite")
    _req(
        math.isfinite(sum(b.weight for b in d.blend)),
        f"data.blend weights {[b.weight for b in d.blend]} sum to infinity: scale them down",
    )
    _req((why := twice(d.blend, "data.blend")) is None, str(why))
    check_stages(d, t, m.seq_length)
    _req(
        t.eval_interval >= 0 and t.eval_iters >= 1,
        f"train.eval_interval={t.eval_interval} must be >= 0 and train.eval_iters={t.eval_iters} >= 1",
    )
    _req(
        t.sample_interval >= 0 and t.sample_tokens >= 1,
        f"train.sample_interval={t.sample_interval} must be "
        f">= 0 and train.sample_tokens={t.sample_tokens} >= 1",
    )
    _req(
        t.downstream_interval == 0 or bool(t.downstream_tasks),
        f"train.downstream_interval={t.downstream_interval} needs train.downstream_tasks=[task,...] "
        "(lm-eval names)",
    )
    _req(
        t.eval_interval == 0 or data_kind(d.kind).own_valid or d.valid_fraction > 0,
        f"train.eval_interval={t.eval_interval} needs a validation split: set data.valid_fraction > 0",
    )


def check_stages(d, t, seq_length: int) -> None:
    """data.stages: each a non-empty blend of distinct folders and one end >= 1 (the last may be open), ends
    increasing."""
    from megaframe.data.record import twice
    from megaframe.data.stages import stage_ends

    _req(
        not (d.stages and d.blend),
        "data.stages and data.blend are both set: the stages carry their own blends",
    )
    for k, s in enumerate(d.stages):
        _req(bool(s.blend), f"data.stages[{k}] needs a blend")
        for i, b in enumerate(s.blend):
            _req(
                bool(b.path) and 0 < b.weight < float("inf"),
                f"data.stages[{k}].blend[{i}] needs a path and a finite weight > 0 (got weight={b.weight})",
            )
        _req((why := twice(s.blend, f"data.stages[{k}].blend")) is None, str(why))
        # a stage ending at step <= 0 never trains and sends later stages' stream positions negative; nan/inf
        # cannot be rounded to a step
        for name in ("until_step", "until_tokens"):
            end = getattr(s, name)
            _req(
                end is None or (math.isfinite(end) and end >= 1),
                f"data.stages[{k}].{name}={end} must be >= 1 and finite",
            )
        _req(
            s.until_step is None or s.until_tokens is None,
            f"data.stages[{k}] sets until_step={s.until_step} and until_tokens={s.until_tokens}: give one",
        )
        _req(
            k == len(d.stages) - 1 or s.until_step is not None or s.until_tokens is not None,
            f"data.stages[{k}] has no end (until_step or until_tokens): only the last stage may be open",
        )
    ends = stage_ends(d.stages, t.global_batch_size, seq_length) if d.stages else []
    for k in range(1, len(ends)):
        _req(
            ends[k] > ends[k - 1],
            f"data.stages[{k}] ends at or before data.stages[{k - 1}] "
            "(compare them in samples: until_tokens is rounded up to a global batch)",
        )


def check_prepared_folders(d: DataConfig, vocab_size: int) -> None:
    """Every prepared dataset (data.path, or each data.blend path) is whole and fits the model."""
    from megaframe.data.shards import check_datasets

    try:
        check_datasets(d, vocab_size)
    except ValueError as e:
        raise ConfigError(_one_line(e)) from e
