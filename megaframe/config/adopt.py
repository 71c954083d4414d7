"""Settings a run takes from outside its command line, applied by load_config before validation. Each step
returns a new config (dataclasses.replace) rather than writing into the one it is given.

- `checkpoint.resume=PATH`: every model.* field the command line does not set comes from the
  checkpoint's recorded config (metadata.json), so resuming, or continuing an imported model, needs no
  model.* overrides. A field the command line sets to another value than the checkpoint's is refused
  with one line naming the field and both values (resume-time checks then see equal values), except
  the few fields that shape no weight and that a continued run may change on purpose (SOFT).
  `model=PRESET` on the command line counts as setting the fields that preset sets to a value (a
  preset that leaves vocab_size to the data sets no vocab_size). A field left unset (None) is never a
  contradiction: it takes the checkpoint's value.
- `WANDB_MODE` in the environment sets logging.wandb.mode unless the command line sets it (wandb's own
  rule: the variable wins over a program default).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from megaframe.config.schema import CONF_DIR, ModelConfig, WandbMode, enum_fields
from megaframe.errors import ConfigError

SOFT = frozenset(
    {
        "name",
        "dropout",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_bias_update_rate",
        "moe_capacity_factor",
        "moe_force_balance",
        "moe_seq_aux_loss_coeff",
        "mtp_loss_weight",
        "init_std",
        "max_position_embeddings",
    }
)
"""model.* fields a resume may change without a refusal: none shapes a weight or the function computed at
inference (the init std only matters for a fresh start; max_position_embeddings is what export advertises;
moe_force_balance does change the routing, on purpose: a throughput benchmark may run a trained checkpoint
under it). A RoPE model's seq_length is soft too (soft_fields): RoPE has no position table, so continued
pretraining may use another context length, as Megatron's --seq-length may differ at a load."""


def soft_fields(saved: dict) -> frozenset:
    """SOFT, with seq_length for a RoPE model (the checkpoint's model, as recorded)."""
    rope = str(saved.get("position_embedding", "rope")) == "rope"
    return SOFT | {"seq_length"} if rope else SOFT


WANDB_MODES = {
    "online": "online",
    "offline": "offline",
    "disabled": "disabled",
    "dryrun": "offline",
    "run": "online",
}
"""WANDB_MODE values wandb accepts, and the logging.wandb.mode each means."""


def _keys(overrides: list[str]) -> set[str]:
    # +key adds, ~key deletes: both name it
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def preset_fields(name: str) -> set[str]:
    """The model.* fields preset conf/model/NAME.yaml sets to a value (null entries set nothing)."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        return set()  # Hydra refuses an unknown preset itself, naming it
    loaded = OmegaConf.to_container(OmegaConf.load(path))
    return {k for k, v in (loaded or {}).items() if v is not None}


def set_on_command_line(overrides: list[str]) -> set[str]:
    """model.* field names the command line sets: its model.* keys, and the fields a model=PRESET sets."""
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    mine = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    if "model" in keys:
        mine |= preset_fields(keys["model"])
    return mine


def checkpoint_model(path: str) -> dict | None:
    """The model config recorded in a checkpoint folder's metadata.json (None if it records none)."""
    try:
        meta = json.loads((Path(path) / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.resume={path}: unreadable metadata.json ({type(e).__name__})") from e
    model = (meta.get("config") or {}).get("model") if isinstance(meta, dict) else None
    return model if isinstance(model, dict) else None


def resume_point(cfg):
    """checkpoint.resume=<a checkpoint dir> means the checkpoint its `latest` names (checkpoint/resolve.py):
    the explicit way to continue a folder another run wrote (runops/access/owner.py), e.g. a resubmitted job
    with a new run.dir. Returns the config with that step folder, so every later check and the resume see one
    path."""
    r = cfg.checkpoint.resume
    # Path("") is the current folder: `checkpoint.resume=$CKPT` with the variable unset
    if not str(r).strip():
        raise ConfigError(
            f"checkpoint.resume={r!r} must be auto, none or a checkpoint path (an unset shell variable?)"
        )
    if r in ("auto", "none") or not Path(r).is_dir() or (Path(r) / "metadata.json").is_file():
        return cfg  # a missing path or a step folder: validate checks it as before
    from megaframe.checkpoint.metadata import CheckpointError
    from megaframe.checkpoint.resolve import step_folder

    try:
        step = str(step_folder(r, warn=lambda msg: None))
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.resume={r}: {e}") from None
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=step))


def adopt_model(cfg, overrides: list[str]):
    """cfg with its model filled from checkpoint.resume=PATH (see the module doc).
    A missing metadata.json is left to validate, which refuses it with its own message."""
    path = cfg.checkpoint.resume
    # resume=auto's checkpoint is chosen later, by the ranks
    # together: only an explicit path can shape the config now
    if path in ("auto", "none") or not (Path(path) / "metadata.json").is_file():
        return cfg
    saved = checkpoint_model(path)
    if not saved:
        return cfg
    mine = set_on_command_line(overrides)
    soft = soft_fields(saved)
    changes = {}
    enums = enum_fields(ModelConfig)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in saved:
            continue
        theirs, current = saved[f.name], getattr(cfg.model, f.name)
        if dataclasses.is_dataclass(current):  # a nested group (rope_scaling): typed as Hydra would type it
            theirs = _group(type(current), theirs, path, f.name)
        if f.name in enums:  # typed as Hydra would have typed it: the checkpoint records plain strings
            try:
                theirs = enums[f.name](theirs)
            except ValueError as e:
                raise ConfigError(
                    f"checkpoint.resume={path}: its model.{f.name}={theirs!r} is not one of "
                    f"{', '.join(enums[f.name])}"
                ) from e
        # None is unset: the checkpoint's value is no contradiction
        if _sets(mine, f.name) and current is not None:
            if current != theirs and f.name not in soft:
                raise ConfigError(contradiction(f.name, current, theirs, saved.get("name"), overrides, path))
        elif current != theirs:
            changes[f.name] = theirs
    # recorded before model.family existed: the family its fields fit (load_config infers it), not the
    # default preset's
    if "family" not in saved and not _sets(mine, "family"):
        changes["family"] = None
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def _sets(mine: set[str], name: str) -> bool:
    """Whether the command line sets model.NAME, or a field inside it (model.rope_scaling.factor=...)."""
    return name in mine or any(k.startswith(name + ".") for k in mine)


def _group(cls, theirs, path: str, name: str):
    """A nested model group recorded as a dict, as its dataclass (keys it predates keep their defaults)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), theirs))
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(
            f"checkpoint.resume={path}: its model.{name}={theirs!r} is not valid ({str(e).splitlines()[0]})"
        ) from None


def contradiction(name: str, mine, theirs, saved_preset, overrides: list[str], path: str) -> str:
    """The refusal of a model field that differs from the checkpoint's: naming the override the user typed,
    model.NAME=... or, when it came from a preset, model=PRESET and the checkpoint's own preset."""
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    if name == "seq_length":  # soft for RoPE: only a learned-position model gets here
        return (
            f"model.seq_length={mine} contradicts the checkpoint's model.seq_length={theirs} "
            f"(checkpoint.resume={path}): a learned-position model (model.position_embedding=learned) "
            f"holds one trained embedding per position, {theirs} rows, so its context length cannot "
            "change (a RoPE model's can); drop the override to use the checkpoint's"
        )
    if f"model.{name}" in keys or "model" not in keys:
        return (
            f"model.{name}={mine} contradicts the checkpoint's model.{name}={theirs} "
            f"(checkpoint.resume={path}); drop the override to use the checkpoint's"
        )
    return (
        f"model={keys['model']} (model.{name}={mine}) contradicts the checkpoint's model, a {saved_preset} "
        f"(model.{name}={theirs}) (checkpoint.resume={path}); "
        f"drop model={keys['model']} to use the checkpoint's"
    )


def apply_environment(cfg, overrides: list[str]):
    """cfg with WANDB_MODE's logging.wandb.mode, unless the command line sets it."""
    env = os.environ.get("WANDB_MODE")
    if not env or "logging.wandb.mode" in _keys(overrides):
        return cfg
    if env.lower() not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} in the environment must be one of {', '.join(WANDB_MODES)}")
    wandb = dataclasses.replace(cfg.logging.wandb, mode=WandbMode(WANDB_MODES[env.lower()]))
    return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, wandb=wandb))
