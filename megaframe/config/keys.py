"""The config's loading rules beside the schema (megaframe/config/loading.py): every overridden key must be a
schema key (Hydra's `+key=value` would otherwise add a key no dataclass reads: the setting silently
vanished), and model.vocab_size, when unset, comes from the prepared data."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import get_type_hints

from megaframe.config.schema import Config
from megaframe.errors import ConfigError
from megaframe.errors import one_line as _one_line

PLANNER_KEYS = (
    "world_size",
    "device_memory_gb",
    "plan_json",
    "search",
    "device",
    "top",
    "efficiency",
    "link_timeout_s",
    "device_profile",
    "measure",
    "measure_steps",
)
"""The planner's own `+key=value` settings (megaframe.plan removes them before load_config). Kept here,
below the config loader, so the loader can name them without importing the planner."""


def take_tool_keys(argv: list[str], keys) -> tuple[dict[str, str], list[str]]:
    """A tool's own `+key=value` settings (`keys`; accepted without the + too) and the remaining Hydra
    overrides, in order. Taken out before composing: the schema has no such fields and Hydra would refuse
    them. `key=` with no value stays an override (so the loader names it)."""
    own, rest = {}, []
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if key in keys and value:
            own[key] = value
        else:
            rest.append(a)
    return own, rest


def tool_keys() -> dict[str, str]:
    """`+key=value` settings that belong to a tool, not to the config (PLANNER_KEYS); anywhere else they
    are refused with the tool's name."""
    return {k: "python -m megaframe.plan" for k in PLANNER_KEYS}


def schema_keys(node: type = None, prefix: str = "") -> set[str]:
    """Every dotted key of the schema, groups (model, train, logging.wandb) included."""
    out: set[str] = set()
    for f in dataclasses.fields(node or Config):
        key = prefix + f.name
        out.add(key)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= schema_keys(type(default), key + ".")
    return out


def check_override_keys(overrides: list[str]) -> None:
    """Refuse an override of a key that is not in the schema, `+`/`++` ones included: Hydra would add
    the key to the composed config, where no dataclass reads it (the setting silently vanished).
    The hint names the closest schema key, never a `+` form."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(_one_line(e)) from e
    known, flags = schema_keys(), bool_keys()
    for o, text in zip(parsed, overrides):
        key = o.key_or_group
        if key in flags:
            _check_bool(o, text, key)
        if key in known or key.startswith("hydra.") or _under_container(key, known):  # hydra.* is Hydra's own
            continue
        tools = tool_keys()
        if key in tools:
            raise ConfigError(f"{text}: {key} is a setting of {tools[key]}, not a config key")
        # 0.6: difflib's default; typos like "trian.seed" still match, unrelated keys don't
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else " (python train.py --cfg lists the keys)"
        raise ConfigError(f"{text}: {key} is not a config key{hint}")
    _check_one_source(parsed, overrides)


def _check_one_source(parsed, overrides: list[str]) -> None:
    """data.path and data.blend (or data.stages) typed together: the blend trains and data.path was silently
    ignored. Refused naming both, so the user says which one they meant (a data.path from the data=
    preset is not typed: data.blend replaces it, as documented)."""
    typed = {o.key_or_group: (o, text) for o, text in zip(parsed, overrides) if not o.is_delete()}
    path = typed.get("data.path")
    if path is None or not path[0].value():
        return
    mix = next(
        (
            text
            for key, (_, text) in typed.items()
            if key.split(".")[:2] in (["data", "blend"], ["data", "stages"])
        ),
        None,
    )
    if mix is not None:
        raise ConfigError(
            f"{path[1]} and {mix} are both set: a blend (or stages) trains instead of data.path, "
            "which would be ignored; drop one of them"
        )


def bool_keys(node: type = None, prefix: str = "") -> set[str]:
    """Every dotted key of a bool field of the schema (checkpoint.async included)."""
    out: set[str] = set()
    hints = get_type_hints(node or Config)
    for f in dataclasses.fields(node or Config):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= bool_keys(type(default), prefix + f.name + ".")
        elif hints.get(f.name) is bool:
            out.add(prefix + f.name)
    return out


def _check_bool(o, text: str, key: str) -> None:
    """A bool field takes true or false only. OmegaConf also reads 2, 'yes', 'on', 'y' and '1' as true
    (optim.overlap_param_gather=2 was accepted as true): a typo or a misplaced number is refused instead."""
    value = o.value()
    if o.is_delete() or isinstance(value, bool) or (isinstance(value, str) and value.startswith("${")):
        return  # ~key, a real bool, or an interpolation (typed by OmegaConf when it resolves)
    raise ConfigError(f"{text} must be true or false ({key} is a bool)")


def _under_container(key: str, known: set[str]) -> bool:
    """data.blend.0.path and the like: keys inside a list or dict field are typed by Hydra itself."""
    head = key.rsplit(".", 1)[0]
    while "." in head and head not in known:
        head = head.rsplit(".", 1)[0]
    return head in CONTAINER_KEYS and key.startswith(head + ".")


CONTAINER_KEYS = {"data.blend", "parallel.pp_layout"}


VOCAB_PAD = 128
"""Megatron's make-vocab-size-divisible-by: every tp up to 128 (powers of two) divides the padded size,
so the default does not change with the layout; the extra rows are never a target (never learned)."""


def default_vocab_size(cfg: Config) -> int:
    """model.vocab_size when left unset: the prepared data's tokenizer vocabulary (the first dataset the run
    reads, as for the tokenizer it records: the first stage's first source, else the first blend source, else
    data.path; blended data shares one tokenizer), else data.vocab_size (synthetic data, or data not prepared
    yet), padded to a multiple of VOCAB_PAD and of parallel.tp."""
    from megaframe.config.rules import FIELD_RULES, check_option
    from megaframe.data.kinds import data_folders

    d = cfg.data
    # the model's vocabulary is derived from it: a bad one is named as typed (it was model.vocab_size=0)
    check_option(f"data.vocab_size={d.vocab_size}", d.vocab_size, FIELD_RULES["data.vocab_size"])
    vocab = d.vocab_size
    path = next((p for _, p in data_folders(d)), "")  # a stage without a blend: refused by the checks
    if path:
        try:
            vocab = int(json.loads((Path(path) / "meta.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not prepared (yet): the data check names the problem when it matters
    # lcm: a tp that does not divide 128 (3, 6) still gets a vocabulary it divides
    pad = math.lcm(VOCAB_PAD, max(1, cfg.parallel.tp))
    return -(-vocab // pad) * pad
