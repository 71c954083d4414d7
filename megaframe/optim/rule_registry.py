"""The registered update rules (optim/update_rule.py), by the name optim.name chooses. A new rule is its own
module defining `RULE` (an UpdateRule) and one entry here. Torch-free until a rule is asked for: loading a
config checks the name without importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from megaframe.errors import ConfigError

if TYPE_CHECKING:
    from megaframe.optim.update_rule import UpdateRule

RULES = {"adamw": "megaframe.optim.adamw", "muon": "megaframe.optim.muon"}
"""optim.name -> the module whose RULE it is."""


def check_rule_name(name: str) -> None:
    """ConfigError naming the choices when `name` is no registered rule."""
    if name not in RULES:
        choices = ", ".join(RULES)
        raise ConfigError(f"optim.name={name!r} is not a registered update rule (choose from {choices})")


def rule_named(name: str) -> UpdateRule:
    """The rule registered as `name`."""
    check_rule_name(name)
    rule = importlib.import_module(RULES[name]).RULE
    assert rule.name == name, (rule.name, name)
    return rule
