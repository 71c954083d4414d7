"""What a resume may change: the checkpoint's config against the run's, before any weight is loaded.

A resumed run must continue the same experiment. These changes are refused (exit 2, one line), unless
`checkpoint.allow_config_change` names the field (then logged):
- train.global_batch_size: the sample position is step x batch, so a new batch would skip or repeat
  samples. When allowed, the data continues from the checkpoint's consumed samples (exact accounting:
  position = consumed at resume + (step - resume step) x new batch), not from step x new batch.
- train.seed: the sample order (and init) derive from it; a new seed repeats and skips data at random.
- any model.* field (model.name, a label, and model.max_position_embeddings, what export advertises,
  excepted): the weights would be loaded into another model, e.g. a changed model.rope_theta loads
  without an error and trains a different function.
- model.seq_length is the exception for a RoPE model (no position table): a step-0 checkpoint (an import)
  may continue at any context length; once samples were consumed the sample order is rebuilt for the new
  sample length, so it needs allow_config_change. The data then continues at the same consumed token count
  (position ceil(tokens / new seq_length) of the new order, resume_position): within the epoch under way
  some tokens already trained on repeat and others are skipped. A learned-position model is refused even
  when allowed (its table has one row per position).
- what the run trains on (megaframe.data.record): data.stages, data.blend (paths or weights), a plain run's
  data.path, data.valid_fraction, and the content of a dataset at the same path; each re-maps the stream's
  positions (samples repeat and others are skipped) or moves the validation split onto trained-on documents.
  When allowed, the warning says what repeats or changes. The tokenizer is compared before (config/checks.py).
- the sample position itself (consumed_samples, consumed_tokens, the data record) is no setting: the save
  seals it (checkpoint/metadata.py: position_sha256) and a hand-edited one is refused, never allowed.
- optim.name: the checkpoint's optimizer state is another update rule's. When allowed, the weights load and
  the new rule's state starts fresh (checkpoint/load.py), said in one line.
A changed optim.state_dtype is no refusal: the state converts as it is read (one line says so).
The parallel layout may change freely (any layout loads any checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path

from megaframe.checkpoint.metadata import position_problem
from megaframe.config.schema import Config, ConfigError, OptimConfig, plain

GUARDED_TRAIN = ("global_batch_size", "seed")
GUARDED_OPTIM = ("name",)
UNCHECKED_MODEL = ("name", "max_position_embeddings")


def differences(cfg: Config, saved: dict, consumed: int = 1) -> list[tuple[str, object, object]]:
    """(field, saved value, current value) of every guarded field that differs. Before any sample is
    consumed (`consumed` = 0: a step-0 checkpoint, e.g. imported from Hugging Face) the data fields
    decide nothing yet and may change."""
    out = []
    cur_train, old_train = plain(cfg.train), saved.get("train", {})
    for k in GUARDED_TRAIN if consumed > 0 else ():
        if k in old_train and old_train[k] != cur_train[k]:
            out.append((f"train.{k}", old_train[k], cur_train[k]))
    # a checkpoint written before optim.name existed holds the default rule's state (the only one then)
    old_optim = saved.get("optim") or {}
    for k in GUARDED_OPTIM:
        old = old_optim.get(k, getattr(OptimConfig, k))
        if old != getattr(cfg.optim, k):
            out.append((f"optim.{k}", old, getattr(cfg.optim, k)))
    cur_model, old_model = plain(cfg.model), saved.get("model", {})
    for k, v in cur_model.items():
        if k not in UNCHECKED_MODEL and k in old_model and old_model[k] != v:
            out.append((f"model.{k}", old_model[k], v))
    return out


def _allowed(name: str, allow: list[str]) -> bool:
    return name in allow or name.split(".")[0] in allow


def check_resume(cfg: Config, meta: dict, path, verbose: bool) -> None:
    """ConfigError on the first change not allowed; the allowed ones are logged (by rank 0, `verbose`)."""
    from megaframe.data.kinds import data_changes

    edited = position_problem(meta)
    if edited:
        # no allowance: the position is the checkpoint's record of what was read, not a setting
        raise ConfigError(
            f"{Path(path) / 'metadata.json'}: {edited} (the file was edited after the save; resumed, the run "
            "would skip or repeat data): restore the saved value or resume from another checkpoint"
        )
    allow = list(cfg.checkpoint.allow_config_change)
    consumed = consumed_samples(meta)
    changes = [
        (name, repr(old), repr(new), None)
        for name, old, new in differences(cfg, meta.get("config") or {}, consumed)
    ]
    # before any sample is consumed (a step-0 import) the data decides nothing yet
    changes += data_changes(cfg.data, meta) if consumed > 0 else []
    for name, old, new, what in changes:
        if name.startswith("optim."):
            what = "the new rule's optimizer state starts fresh"
        if name == "model.seq_length":
            what = seq_change(cfg, old, new, consumed)
            if what is None:  # a RoPE model before any sample was read: the header names the change
                continue
            if what.startswith(LEARNED):  # no allowance helps: the position table has no rows to spare
                raise ConfigError(
                    f"checkpoint {path} was written with {name}={old}, this run has {new}: {what}"
                )
        if not _allowed(name, allow):
            why = (
                "its optimizer state belongs to another update rule"
                if name.startswith("optim.")
                else what
                or (
                    "samples would be skipped or repeated"
                    if name.startswith("train.")
                    else "the weights belong to another model"
                )
            )
            raise ConfigError(
                f"checkpoint {path} was written with {name}={old}, this run has {new}: {why}; "
                f"set checkpoint.allow_config_change=[{name}] to resume anyway"
            )
        if verbose:
            print(
                f"megaframe: warning: resuming with {name} changed from {old} to {new} "
                f"(checkpoint.allow_config_change){f': {what}' if what else ''}",
                file=sys.stderr,
                flush=True,
            )
    _say_state_dtype(cfg, meta, verbose)


def _say_state_dtype(cfg: Config, meta: dict, verbose: bool) -> None:
    """One line when the checkpoint's optimizer state is in another dtype than optim.state_dtype: checkpoint/
    load.py's copies convert it as they read (checkpoints from before the key held fp32 state)."""
    old = ((meta.get("config") or {}).get("optim") or {}).get("state_dtype", OptimConfig.state_dtype)
    if verbose and old != cfg.optim.state_dtype:
        print(
            f"megaframe: warning: resuming with optim.state_dtype={cfg.optim.state_dtype} from a checkpoint "
            f"whose optimizer state is {old}: converted as it is read",
            file=sys.stderr,
            flush=True,
        )


LEARNED = "a learned-position model"


def seq_change(cfg: Config, old: str, new: str, consumed: int) -> str | None:
    """What a changed model.seq_length does; None when it changes nothing but the model's context
    (a RoPE model whose checkpoint consumed no sample yet, e.g. an import)."""
    if str(cfg.model.position_embedding) != "rope":
        return (
            f"{LEARNED} (model.position_embedding=learned) holds one trained embedding per position, "
            f"{old} rows: its context length cannot change (a RoPE model's can)"
        )
    if consumed == 0:
        return None
    from megaframe.data.kinds import data_kind

    # an endless kind draws sample i from (seed, i): none is read twice
    if data_kind(cfg.data.kind).endless:
        return (
            f"RoPE allows it; {consumed} samples of {old} tokens were consumed and the {cfg.data.kind} "
            f"samples go on at the same token count in samples of {new} tokens (none repeated)"
        )
    return (
        f"RoPE allows it, but {consumed} samples of {old} tokens were consumed and the sample order is "
        f"rebuilt for samples of {new} tokens: the data continues at the same token count, and until this "
        "epoch ends some tokens already trained on repeat and others are skipped"
    )


def resume_position(meta: dict, seq_length: int) -> tuple[int, int]:
    """(samples, tokens) consumed at a resume, the samples counted in this run's seq_length: the
    checkpoint's own count when the length is the one it ran with, else its tokens in samples of the new
    length rounded up (the data goes on at the same token count; a RoPE seq_length change)."""
    samples = consumed_samples(meta)
    old = int(((meta.get("config") or {}).get("model") or {}).get("seq_length") or seq_length)
    tokens = int(meta.get("consumed_tokens", samples * old))
    if old == seq_length:
        return samples, tokens
    return -(-tokens // seq_length), tokens


def consumed_samples(meta: dict) -> int:
    """Samples the checkpoint's run had consumed (older checkpoints: step x its global batch)."""
    if "consumed_samples" in meta:
        return int(meta["consumed_samples"])
    gbs = int((meta.get("config") or {}).get("train", {}).get("global_batch_size", 0))
    # no recorded count: exact as long as that run never changed its batch size
    return int(meta["step"]) * gbs


class Accounting:
    """Global sample positions of a run that resumed at `start` with `base` samples consumed:
    step s (1-based) reads positions [base + (s - 1 - start)·G, base + (s - start)·G)."""

    def __init__(self, start: int, base: int, global_batch: int, seq_length: int = 0, tokens: int = -1):
        self.start, self.base, self.gbs, self.seq = start, base, global_batch, seq_length
        # tokens consumed at the resume: recorded apart from samples, whose length a RoPE resume may change
        self.base_tokens = base * seq_length if tokens < 0 else tokens

    def consumed(self, step: int) -> int:
        """Samples consumed once step `step` is done."""
        # from the resume's consumed count, not step x batch: exact when an allowed batch-size change was made
        return self.base + (step - self.start) * self.gbs

    def consumed_tokens(self, step: int) -> int:
        """Training tokens consumed once step `step` is done (inputs: seq_length per sample)."""
        return self.base_tokens + (step - self.start) * self.gbs * self.seq
