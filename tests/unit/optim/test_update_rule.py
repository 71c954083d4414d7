"""The update-rule seam (optim/update_rule.py, optim/rule_registry.py): every registered rule is complete, its
state names are written in its own module only (the strategies, checkpoints, save guard and planner read
them from the rule), and a rule that needs whole matrices is refused by ZeRO's flat owned ranges."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from megaframe.config import ConfigError
from megaframe.config.choices import StateDtype
from megaframe.config.schema import OptimConfig
from megaframe.optim.rule_registry import RULES, rule_named
from megaframe.optim.zero_state import build_state

PACKAGE = Path(__file__).resolve().parents[3] / "megaframe"


@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_is_complete(name):
    rule = rule_named(name)
    assert rule.name == name and rule.states
    for dtype in StateDtype:
        assert len(rule.state_bytes[dtype]) == len(rule.states), dtype
    assert rule.bytes_per_element("bf16") < rule.bytes_per_element("fp32")


@pytest.mark.parametrize("name", list(RULES))
def test_a_rules_state_names_are_written_in_its_own_module_only(name):
    own = Path(inspect.getfile(importlib.import_module(RULES[name]))).resolve()
    quoted = re.compile("|".join(rf"[\"']{re.escape(s)}[\"'/]" for s in rule_named(name).states))
    elsewhere = [
        str(f.relative_to(PACKAGE))
        for f in PACKAGE.rglob("*.py")
        if f.resolve() != own and quoted.search(f.read_text())
    ]
    assert not elsewhere, elsewhere


def test_zero_refuses_a_rule_that_needs_whole_matrices():
    whole = dataclasses.replace(rule_named(OptimConfig.name), name="whole", elementwise=False)
    with pytest.raises(ConfigError, match="optim.name=whole updates whole matrices"):
        build_state([], whole, OptimConfig(), None, False)
