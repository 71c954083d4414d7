"""Every optimizer implements optim/protocol.py's Optimizer, checked by the ABC: a class missing one of the
contract's methods cannot be built, and build_optimizer returns an Optimizer for each zero setting."""

from __future__ import annotations

import inspect

import pytest

from megaframe.optim.build import PlainOptimizer, build_optimizer
from megaframe.optim.protocol import Optimizer
from megaframe.optim.zero import ZeroOptimizer
from megaframe.optim.zero3 import Zero3Optimizer
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model

CONTRACT = {
    "zero_grad",
    "backward_context",
    "step",
    "logical_state",
    "load_targets",
    "loaded",
    "held_state",
    "memory_bytes",
    "sync_params",
    "settle",
}


def test_the_contract_is_the_ten_methods_the_loop_and_checkpoints_call():
    assert Optimizer.__abstractmethods__ == CONTRACT


@pytest.mark.parametrize("cls", [PlainOptimizer, ZeroOptimizer, Zero3Optimizer])
def test_each_optimizer_implements_every_method(cls):
    assert issubclass(cls, Optimizer) and not inspect.isabstract(cls), cls.__abstractmethods__


def test_a_class_missing_a_method_cannot_be_built():
    methods = {name: getattr(PlainOptimizer, name) for name in CONTRACT - {"settle"}}
    no_settle = type("NoSettle", (Optimizer,), methods)
    with pytest.raises(TypeError, match="settle"):
        no_settle()


@pytest.mark.parametrize(
    "precision,zero,cls",
    [("fp32", 0, PlainOptimizer), ("bf16", 1, ZeroOptimizer), ("bf16", 2, ZeroOptimizer)],
)
def test_build_optimizer_returns_an_optimizer(precision, zero, cls):
    cfg = tiny_config([f"train.precision={precision}", f"optim.zero={zero}"], 1)
    mesh = single_process_mesh("cpu")
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    assert isinstance(opt, Optimizer) and type(opt) is cls
