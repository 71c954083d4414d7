"""One builder: every model a command runs is assembled by model/parallelize.py (the stage from the run's
schedule, one cast to train.precision, then the optimizer), and the model code itself knows no optimizer
and no schedule."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from megaframe.model.gpt import GPT
from megaframe.model.parallelize import whole_model
from megaframe.optim.protocol import Optimizer
from megaframe.parallel.mesh import single_process_mesh
from megaframe.parallel.virtual import virtual_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build, build_model

PACKAGE = Path(__file__).resolve().parents[3] / "megaframe"


def imported(path: Path) -> set[str]:
    """Every module `path` imports, function-level imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_model_code_imports_no_optimizer_and_no_schedule():
    mods = imported(PACKAGE / "model" / "gpt.py")
    assert not {m for m in mods if m.startswith("megaframe.optim") or m == "megaframe.pipeline.schedule"}, (
        mods
    )


def test_only_the_builder_assembles_a_model():
    """A GPT made elsewhere in the package would skip the stage, the cast or the schedule the builder
    applies."""
    makers = [
        str(f.relative_to(PACKAGE))
        for f in PACKAGE.rglob("*.py")
        if f.name != "parallelize.py" and re.search(r"(?<![\w.])GPT\((?!nn\.Module)", f.read_text())
    ]
    assert makers == []


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_build_gives_the_runs_dtype_and_an_optimizer(precision, dtype):
    cfg = tiny_config([f"train.precision={precision}", "optim.zero=1"], 1)
    model, optimizer = build(cfg, single_process_mesh("cpu"))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert isinstance(optimizer, Optimizer)


@pytest.mark.parametrize(
    "kind,vpp,name,v",
    [("auto", 1, "1f1b", False), ("auto", 2, "interleaved", False), ("zbv", 2, "zbv", True)],
)
def test_the_schedule_is_resolved_once_and_places_the_stage(kind, vpp, name, v):
    cfg = tiny_config(
        [
            "model.num_layers=4",
            "parallel.pp=2",
            f"parallel.pp_schedule={kind}",
            f"parallel.vpp={vpp}",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
        ],
        2,
    )
    model = build_model(cfg, virtual_mesh(1, 2, 1, pp_rank=0, device="meta"))
    assert model.schedule == name
    # rank 0 of a V holds both ends (stages 0 and 3); of a loop, stages 0 and 2
    assert model.stage.first and model.stage.last is v


def test_whole_model_is_fp32_and_whole():
    cfg = tiny_config([], 1)
    model = whole_model(cfg.model)
    assert isinstance(model, GPT) and model.stage.first and model.stage.last
    assert {p.dtype for p in model.parameters()} == {torch.float32}
