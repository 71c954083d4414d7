"""The update-rule seam (optim/update_rule.py, optim/rule_registry.py): every registered rule is complete, its
state names are written in its own module only (the strategies, checkpoints, save guard and planner read
them from the rule), and a rule may keep other state on hidden matrices than on the rest (Muon)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from megaframe.config.choices import StateDtype
from megaframe.layers.shard import Shard
from megaframe.optim.rule_registry import RULES, rule_named
from megaframe.parallel.placement import Placement

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
    # a rule may hold another's state (Muon keeps AdamW's moments on the rest): the name is then that rule's
    for state in rule_named(name).states:
        homes = {_module_file(r) for r in RULES if state in rule_named(r).states}
        elsewhere = [
            str(f.relative_to(PACKAGE))
            for f in PACKAGE.rglob("*.py")
            if f.resolve() not in homes and _quoted(state).search(f.read_text())
        ]
        assert not elsewhere, (state, elsewhere)


def _module_file(name: str) -> Path:
    return Path(inspect.getfile(importlib.import_module(RULES[name]))).resolve()


def _quoted(state: str) -> re.Pattern:
    return re.compile(rf"[\"']{re.escape(state)}[\"'/]")


def test_muon_keeps_momentum_on_hidden_matrices_and_adamws_moments_on_the_rest():
    rule = rule_named("muon")
    qkv = Placement(Shard((96, 32), 0, (32, 32, 32)))
    expert = Placement(Shard((4, 96, 32), 0, (4,), axis="ep"), expert_rows=(48, 48))
    embedding = Placement(Shard((256, 32), 0, (256,)), role="embedding")
    norm = Placement(Shard((32,)))
    assert qkv.hidden_matrix and expert.hidden_matrix
    assert not embedding.hidden_matrix and not norm.hidden_matrix
    assert qkv.matrix_rows == (32, 32, 32) and expert.matrix_rows == (48, 48)
    assert rule.states_for(qkv) == ("momentum_buffer",) == rule.states_for(expert)
    assert rule.states_for(embedding) == rule_named("adamw").states == rule.states_for(norm)
    assert (rule.bytes_per_element("fp32", qkv), rule.bytes_per_element("bf16", qkv)) == (4, 2)
    assert (rule.bytes_per_element("fp32", norm), rule.bytes_per_element("bf16", norm)) == (8, 4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_holds_each_params_own_state_names_only(dtype):
    """ZeRO's flat state keeps a name only for the params whose kind holds it (Muon: momentum on the hidden
    matrices, AdamW's moments on the rest): the bytes per element a zero=0 run holds, not every name's."""
    from megaframe.optim.build import build_optimizer
    from megaframe.parallel.mesh import single_process_mesh
    from tests.distributed.cases import tiny_config
    from tests.forms import build_model

    # bf16 params: one process keeps ZeRO's flat state (and an fp32 master, 4 bytes an element)
    over = ["optim.name=muon", "optim.zero=1", f"optim.state_dtype={dtype}", "train.precision=bf16"]
    cfg = tiny_config(over, 1)
    mesh = single_process_mesh()
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    opt.make_state()
    for t in opt.held_state():  # distinct values, so a misplaced read shows
        t.copy_(torch.randn(t.shape))
    rule = rule_named("muon")
    want = sum((rule.bytes_per_element(dtype, p.placement) + 4) * p.numel() for p in model.parameters())
    assert opt.memory_bytes()["mem/optim_bytes"] == want
    for p in model.parameters():
        (_, _, views), logical = *opt.state_segments(p), opt.logical_state(p)
        assert set(views) == {*rule.states_for(p.placement), "master"} == set(logical), views.keys()
        for k, v in views.items():  # the gathered logical state reads the packed names at their place
            assert logical[k].data_ptr() != v.data_ptr() and logical[k].reshape(-1).equal(v)
