"""The config is frozen once load_config returns it: every component reads one settled set of values, and a
value worked out from the settings (the resolved pipeline schedule, the LR horizon, ...) lives in the
derived record (config/derived.py) instead of being written back into the config.

Every schema dataclass derives from `Frozen`. `freeze` marks a loaded tree; an assignment to any field of it
then raises `FrozenConfigError` naming the key. A config built directly (`Config()`, `dataclasses.replace`)
is not frozen: tests and tools compose one by hand before handing it over. A leaf module.
"""

from __future__ import annotations

import dataclasses


class FrozenConfigError(dataclasses.FrozenInstanceError):
    """An assignment to a loaded config (an AttributeError, as a frozen dataclass raises)."""


class Frozen:
    """Base of the schema dataclasses: assignment raises once `freeze` has marked the instance."""

    def __setattr__(self, name: str, value) -> None:
        at = self.__dict__.get("_frozen_at")
        if at is not None:
            raise FrozenConfigError(
                f"{at}{name}={value!r}: the config is frozen "
                "after load_config; pass the value as an override "
                f"(load_config([..., '{at}{name}=...'])), build "
                "a new config with dataclasses.replace, or keep "
                "a value worked out from the config in megaframe.config.derived.Derived"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen_at") is not None:
            raise FrozenConfigError(
                f"{self.__dict__['_frozen_at']}{name}: the config is frozen after load_config"
            )
        object.__delattr__(self, name)


def freeze(cfg, at: str = ""):
    """Mark `cfg` and every config group inside it (lists of groups included) frozen; returns `cfg`."""
    object.__setattr__(cfg, "_frozen_at", at)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, Frozen):
                freeze(item, f"{at}{f.name}{f'[{i}]' if isinstance(value, list) else ''}.")
    return cfg


def thawed(cfg):
    """A deep copy of `cfg` that is not frozen (a variant built field by field, as the rule tests build one
    bad value per field); `cfg` itself stays frozen."""
    import copy

    twin = copy.deepcopy(cfg)
    _unmark(twin)
    return twin


def _unmark(cfg) -> None:
    cfg.__dict__.pop("_frozen_at", None)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Frozen):
                _unmark(item)


def is_frozen(cfg) -> bool:
    return getattr(cfg, "__dict__", {}).get("_frozen_at") is not None
