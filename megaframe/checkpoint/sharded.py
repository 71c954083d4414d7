"""Sharded checkpoints: each rank writes the slices it uniquely owns into one safetensors file.

Layout on disk:
    ${checkpoint.dir}/step_00000008/shard_00000.safetensors ...   tensors keyed model/<name>,
                                                                   optim/exp_avg/<name>, optim/exp_avg_sq/<name>
    ${checkpoint.dir}/step_00000008/metadata.json                 every logical tensor's global shape and dtype,
                                                                   each shard's file, key, dim and ranges
    ${checkpoint.dir}/latest                                       name of the newest committed step folder

A tensor slice is written once: by dp rank 0, and for tp-replicated tensors by tp rank 0 only.
Ranges are (global offset, local offset, length) along the split dim, so a fused [q|k|v] slice is
three ranges. A checkpoint is committed by renaming its temporary folder after metadata.json (written
last, fsynced) exists; `latest` is replaced atomically afterwards. Loading rebuilds each logical tensor
from its shards and cuts the slice the loading rank needs, so any layout loads any checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megaframe.parallel.mesh import Mesh

FORMAT = "megaframe-ckpt-v1"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _owned_tensors(model, optimizer, mesh: Mesh) -> dict[str, tuple[torch.Tensor, object]]:
    """key -> (local tensor, Shard) for the slices this rank writes.

    Every dp rank asks for the optimizer state (a ZeRO optimizer all-gathers its dp-sharded moments
    there, a collective); only dp rank 0 writes."""
    out = {}
    for name, p in model.named_parameters():
        if (p.shard.dim is None and mesh.tp.rank != 0) or getattr(p, "pp_duplicate", False):
            continue
        state = optimizer.logical_state(p)
        if mesh.dp.rank != 0:
            continue
        out[f"model/{name}"] = (p.detach(), p.shard)
        for k, t in state.items():
            out[f"optim/{k}/{name}"] = (t, p.shard)
    return out


def _barrier(mesh: Mesh) -> None:
    if mesh.group is not None:
        dist.barrier(group=mesh.group)


def save(root: str | Path, step: int, model, optimizer, mesh: Mesh, meta: dict) -> Path:
    """Write and commit step_XXXXXXXX under root; collective over the mesh. Returns the final folder."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(mesh)
    fname = f"shard_{mesh.rank:05d}.safetensors"
    owned = _owned_tensors(model, optimizer, mesh)
    entries = {}
    if owned:
        save_file({k: t.contiguous().cpu() for k, (t, _) in owned.items()}, str(tmp / fname))
        with open(tmp / fname, "rb") as f:
            os.fsync(f.fileno())
        for k, (t, s) in owned.items():
            entries[k] = {"file": fname, "dim": s.dim, "ranges": s.ranges(), "global_shape": list(s.global_shape),
                          "dtype": str(t.dtype).removeprefix("torch.")}
    gathered = [entries]
    if mesh.group is not None:
        gathered = [None] * mesh.world
        dist.all_gather_object(gathered, entries, group=mesh.group)
    if mesh.rank == 0:
        tensors: dict[str, dict] = {}
        for part in gathered:
            for k, e in part.items():
                t = tensors.setdefault(k, {"global_shape": e["global_shape"], "dtype": e["dtype"], "shards": []})
                t["shards"].append({"file": e["file"], "dim": e["dim"], "ranges": e["ranges"]})
        _fsync_write(tmp / "metadata.json", json.dumps({"format": FORMAT, "step": step, **meta,
                                                        "tensors": tensors}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_write(Path(root) / "latest.tmp", final.name + "\n")
        os.replace(Path(root) / "latest.tmp", Path(root) / "latest")
    _barrier(mesh)
    return final


def latest(root: str | Path) -> Path | None:
    """The newest committed checkpoint under root, or None."""
    pointer = Path(root) / "latest"
    if pointer.is_file():
        path = Path(root) / pointer.read_text().strip()
        if (path / "metadata.json").is_file():
            return path
    done = sorted(p for p in Path(root).glob("step_*") if p.is_dir() and (p / "metadata.json").is_file()
                  and not p.name.endswith(".tmp")) if Path(root).is_dir() else []
    return done[-1] if done else None


def read_metadata(path: str | Path) -> dict:
    meta = json.loads((Path(path) / "metadata.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a megaframe checkpoint (format {meta.get('format')!r})")
    return meta


def load_full(path: str | Path, key: str, meta: dict) -> torch.Tensor:
    """Rebuild one logical tensor from its shards."""
    info = meta["tensors"][key]
    full = torch.empty(info["global_shape"], dtype=getattr(torch, info["dtype"]))
    for shard in info["shards"]:
        with safe_open(str(Path(path) / shard["file"]), framework="pt") as f:
            local = f.get_tensor(key)
        if shard["dim"] is None:
            full.copy_(local)
            continue
        for g, lo, n in shard["ranges"]:
            full.narrow(shard["dim"], g, n).copy_(local.narrow(shard["dim"], lo, n))
    return full


@torch.no_grad()
def load_into(path: str | Path, model, optimizer=None) -> dict:
    """Fill this rank's parameter (and Adam moment) slices from a checkpoint of any layout."""
    meta = read_metadata(path)
    for name, p in model.named_parameters():
        p.copy_(p.shard.local(load_full(path, f"model/{name}", meta)).to(p.device, p.dtype))
        if optimizer is None or f"optim/exp_avg/{name}" not in meta["tensors"]:
            continue
        # "master": fp32 master weights of a bf16 run (written by the ZeRO optimizer)
        moments = {k: p.shard.local(load_full(path, f"optim/{k}/{name}", meta))
                   for k in ("exp_avg", "exp_avg_sq", "master") if f"optim/{k}/{name}" in meta["tensors"]}
        optimizer.load_logical_state(p, moments, int(meta["step"]))
    return meta
