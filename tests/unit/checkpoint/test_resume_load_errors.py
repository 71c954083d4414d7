"""What stops a resume: the checkpoint's own faults make resume=auto skip it; running out of memory (or an
accelerator or collective error) while loading stops the run on the checkpoint it was loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaframe.checkpoint import sharded
from megaframe.checkpoint.resume import resume
from megaframe.errors import TrainingError
from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from megaframe.runops.faults import Injector, parse
from tests.distributed.cases import tiny_config
from tests.forms import build_model


@pytest.fixture
def two_saved(tmp_path):
    cfg = tiny_config([f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=auto"], 1)
    mesh = single_process_mesh()
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    for step, lineage in (
        (3, {"id": "a3", "run_id": "r"}),
        (6, {"id": "a6", "run_id": "r", "parent": "step_00000003", "parent_id": "a3"}),
    ):
        # one branch: step 6 descends from step 3
        # (resume=auto walks `latest`'s ancestors, checkpoint/resolve.py)
        sharded.save(cfg.checkpoint.dir, step, model, opt, mesh, {"config": {}, "lineage": lineage})
    return cfg, mesh, model, opt


def _newest_load_raises(monkeypatch, error: BaseException) -> None:
    """sharded.load_into raises `error` for step 6 (the newest) and loads any other checkpoint."""
    real = sharded.load_into

    def load_into(path, *args):
        if path.name == "step_00000006":
            raise error
        return real(path, *args)

    monkeypatch.setattr(sharded, "load_into", load_into)


def _state(root):
    return sorted(p.name for p in root.iterdir()), (root / "latest").read_text()


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError, torch.AcceleratorError, torch.distributed.DistBackendError, MemoryError]
)
def test_out_of_memory_while_loading_stops_instead_of_falling_back(two_saved, monkeypatch, error):
    """The newest checkpoint's load raises error: TrainingError (train.py: exit 1) naming the phase and that
    checkpoint; nothing skipped or removed, `latest` unchanged. (Before: RuntimeError was "cannot be loaded",
    so resume=auto silently went on from step 3.)"""
    cfg, mesh, model, opt = two_saved
    root = Path(cfg.checkpoint.dir)
    before = _state(root)
    _newest_load_raises(monkeypatch, error("out of memory (test)"))
    with pytest.raises(
        TrainingError, match=r"loading checkpoint \S*step_00000006 failed: rank 0: \w+: out of memory"
    ):
        resume(cfg, model, opt, mesh)
    assert _state(root) == before


def test_a_corrupt_checkpoint_is_still_skipped(two_saved, monkeypatch):
    """The checkpoint's own fault (here a torch shape complaint, a RuntimeError)
    still falls back to step 3."""
    cfg, mesh, model, opt = two_saved
    _newest_load_raises(
        monkeypatch, RuntimeError("The size of tensor a (3) must match the size of tensor b (4)")
    )
    assert resume(cfg, model, opt, mesh).step == 3


def test_injected_load_oom(two_saved):
    """MEGAFRAME_INJECT=loadoom:step=6 (the drill an end-to-end run uses) stops the resume the same way."""
    cfg, mesh, model, opt = two_saved
    faults = Injector(parse("loadoom:rank=0:step=6"), 0)
    with pytest.raises(TrainingError, match="step_00000006 failed: rank 0: OutOfMemoryError: injected"):
        resume(cfg, model, opt, mesh, faults)
    assert (
        resume(cfg, model, opt, mesh, Injector(parse("loadoom:rank=1"), 0)).step == 6
    )  # another rank's fault
