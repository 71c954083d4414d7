"""Checkpoint files on one process: per-block checksums found where read, the offline verifier's exit
codes, a corrupt block failing a load by name, and file names confined to their folder."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from megaframe.checkpoint import sharded
from megaframe.checkpoint.boxes import flat_boxes
from megaframe.checkpoint.metadata import CheckpointError
from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from megaframe.paths import OutsideFolder, inside
from tests.distributed.cases import tiny_config
from tests.e2e.helpers import run
from tests.forms import build_model

PY = [sys.executable, "-m", "megaframe.checkpoint", "verify"]


@pytest.fixture
def saved(tmp_path):
    cfg = tiny_config([], 1)
    mesh = single_process_mesh()
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    path = sharded.save(tmp_path / "ck", 1, model, opt, mesh, {"config": {}})
    return path, cfg, mesh


def flip(path, where: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_cli_and_a_corrupt_block_named_at_load(saved):
    path, cfg, mesh = saved
    ok = run(PY + [str(path)], timeout=120)  # forks of the warm interpreter: the subject is the command
    assert ok.returncode == 0 and "ok:" in ok.stdout, ok.stderr
    shard = path / "shard_00000.safetensors"
    flip(shard, 0.6)  # same size: only the block checksums can see it
    assert sharded.latest(path.parent) == path  # metadata-only: latest() reads no shard bytes
    bad = run(PY + [str(path)], timeout=120)
    assert bad.returncode == 2 and "corrupt" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    model = build_model(cfg, mesh)
    with pytest.raises(CheckpointError, match=r"shard_00000.safetensors is corrupt: tensor \S+#\d+, bytes"):
        sharded.load_into(path, model, build_optimizer(model, cfg.optim, mesh))


def test_file_names_stay_inside_the_folder(tmp_path, saved):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "ok.bin").write_bytes(b"x")
    os.symlink("/etc/hostname", tmp_path / "f" / "out.bin")
    assert inside(tmp_path / "f", "ok.bin") == tmp_path / "f" / "ok.bin"
    for name in ("../ok.bin", "/etc/passwd", "sub/ok.bin", "..", "", "out.bin", None):
        with pytest.raises(OutsideFolder):
            inside(tmp_path / "f", name)
    path, _, _ = saved
    meta = json.loads((path / "metadata.json").read_text())
    meta["files"]["../../evil.safetensors"] = meta["files"].pop("shard_00000.safetensors")
    for t in meta["tensors"].values():
        for s in t["shards"]:
            s["file"] = "../../evil.safetensors"
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not a plain name"):
        sharded.check_complete(path)
    res = run(
        [
            sys.executable,
            "train.py",
            "data=synthetic",
            f"checkpoint.resume={path}",
            f"run.dir={tmp_path / 'run'}",
        ],
        timeout=120,
    )
    assert res.returncode == 2 and "not a plain name" in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_prepared_dataset_naming_a_file_outside_is_refused(tmp_path):
    from megaframe.data.dataset import PreparedData
    from tests.unit.data.test_data_order import write_prepared

    path = write_prepared(tmp_path / "prep", [np.arange(40)])
    meta = json.loads((path / "meta.json").read_text())
    meta["shards"][0]["file"] = "../../../etc/hostname"
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a plain name"):
        PreparedData(path, seq_length=4)


def test_block_checksums_cover_every_byte():
    from megaframe.checkpoint.store import _parse_crcs, block_crcs, block_size

    t = torch.arange(5000, dtype=torch.float32)
    blk, crcs = _parse_crcs(block_crcs(t))
    assert blk == block_size(20000) and len(crcs) == -(-20000 // blk)


def test_a_v1_checkpoint_still_loads(tmp_path, saved):
    """Checkpoints written before format v2 (whole slices keyed by logical name, a crc32 per file) load."""
    import zlib

    from safetensors.torch import save_file

    path, cfg, mesh = saved
    meta = sharded.read_metadata(path)
    tensors = {k: sharded.load_full(path, k, meta) for k in meta["tensors"]}
    old = tmp_path / "v1" / "step_00000001"
    old.mkdir(parents=True)
    save_file(tensors, str(old / "shard_00000.safetensors"))
    crc = zlib.crc32((old / "shard_00000.safetensors").read_bytes())
    v1 = {
        "format": "megaframe-ckpt-v1",
        "step": 1,
        "files": {
            "shard_00000.safetensors": {
                "bytes": (old / "shard_00000.safetensors").stat().st_size,
                "crc32": crc,
            }
        },
        "tensors": {
            k: {
                "global_shape": list(t.shape),
                "dtype": "float32",
                "shards": [{"file": "shard_00000.safetensors", "dim": None, "ranges": []}],
            }
            for k, t in tensors.items()
        },
    }
    (old / "metadata.json").write_text(json.dumps(v1))
    sharded.verify(old)
    model = build_model(tiny_config(["train.seed=9"], 1), mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    sharded.load_into(old, model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), tensors[f"model/{name}"]), name


@pytest.fixture
def trained(tmp_path):
    """A one-process checkpoint after one step (so with Adam moments)
    and a real config (load_model builds from it)."""
    from megaframe.config.schema import plain
    from tests.distributed.zero_cases import _setup, _step

    mesh = single_process_mesh()
    cfg, model, opt, data = _setup(mesh, [], 1)
    _step(mesh, cfg, model, opt, data, 1)
    return sharded.save(tmp_path / "ck", 1, model, opt, mesh, {"config": plain(cfg)}), cfg, mesh


def test_pieces_cut_by_the_staging_buffer_land_exactly(trained, monkeypatch):
    """staging_bytes=1 (one crc block per chunk): every tensor longer than a block arrives in pieces cut at
    chunk ends, and the load equals the checkpoint exactly, weights and moments."""
    from megaframe.checkpoint import load

    path, cfg, mesh = trained
    cuts = []
    monkeypatch.setattr(load, "flat_boxes", lambda *a: cuts.append(a) or flat_boxes(*a))
    model = build_model(tiny_config(["train.seed=9"], 1), mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    meta = sharded.load_into(path, model, opt, staging_bytes=1)
    assert cuts
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), sharded.load_full(path, f"model/{name}", meta)), name
        for k, t in opt.logical_state(p).items():
            assert torch.equal(t, sharded.load_full(path, f"optim/{k}/{name}", meta)), (k, name)


def test_load_model_reads_the_weights_into_the_model(trained, monkeypatch):
    """megaframe.load_model holds the model plus at most one tensor's staging: no copy of the weights, no
    moments read (before: a zero-filled copy of every weight, so twice the model). Host bytes counted by a
    TorchDispatchMode."""
    import megaframe
    from megaframe.model.gpt import GPT
    from tests.distributed.ckpt_cases import HostBytes

    path, cfg, mesh = trained
    build = HostBytes()
    with build:
        model = GPT(cfg.model, mesh, sp=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    figures = {}
    real = sharded.load_into
    monkeypatch.setattr(sharded, "load_into", lambda *a, **k: figures.update(real(*a, **k)["io_load"]))
    count = HostBytes()
    with count:
        megaframe.load_model(str(path))
    print(
        f"\nload_model: host bytes {count.peak} (building the model alone {build.peak}, weights {weights}), "
        f"read {figures['read_data_bytes']}"
    )
    assert count.peak <= build.peak + largest + 4096
    assert figures["needed_bytes"] == weights  # the weights only: no optimizer state read
