"""Sharded checkpoints: each rank writes the slices it uniquely owns into one safetensors file.

Layout on disk:
    ${checkpoint.dir}/step_00000008/shard_00000.safetensors ...   tensors keyed model/<name>,
                                                                   optim/exp_avg/<name>, optim/exp_avg_sq/<name>
    ${checkpoint.dir}/step_00000008/metadata.json                 every logical tensor's global shape and dtype,
                                                                   each shard's file, key, dim and ranges
    ${checkpoint.dir}/latest                                       name of the newest committed step folder

A tensor slice is written once, by the rank holding replica (0, 0, 0) of it (its Placement: tp copy 0,
not the pipeline duplicate, data-parallel rank 0).
Ranges are (global offset, local offset, length) along the split dim, so a fused [q|k|v] slice is
three ranges. A checkpoint is committed by renaming its temporary folder after metadata.json (written
last, fsynced) exists; `latest` is replaced atomically afterwards. Loading rebuilds each logical tensor
from its shards and cuts the slice the loading rank needs, so any layout loads any checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megaframe.parallel.mesh import Mesh

FORMAT = "megaframe-ckpt-v1"
_UMASK = os.umask(0o022)  # read once at import (single-threaded): os.umask can only be read by setting it
os.umask(_UMASK)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _owned_tensors(model, optimizer, mesh: Mesh) -> dict[str, tuple[torch.Tensor, object]]:
    """key -> (local tensor, Shard) for the slices this rank writes (placement.writes_checkpoint).

    Every rank of a data-parallel group that saves a parameter asks for its optimizer state (a ZeRO
    optimizer all-gathers its dp-sharded moments there, a collective); only replica 0 writes."""
    out = {}
    for name, p in model.named_parameters():
        if not p.placement.in_checkpoint(mesh):
            continue
        state = optimizer.logical_state(p)
        if not p.placement.writes_checkpoint(mesh):
            continue
        out[f"model/{name}"] = (p.detach(), p.placement.shard)
        for k, t in state.items():
            out[f"optim/{k}/{name}"] = (t, p.placement.shard)
    for name, b, placement in state_buffers(model):  # state outside autograd (the MoE expert bias)
        if placement.writes_checkpoint(mesh):
            out[f"model/{name}"] = (b.detach(), placement.shard)
    return out


def state_buffers(model) -> list[tuple[str, torch.Tensor, object]]:
    """(global name, tensor, Placement) of buffers that are model state, saved and loaded like parameters.
    A module declares them in `state_placements` ({buffer name: Placement}): a tag on the tensor itself
    would be lost when model.to() replaces buffers."""
    return [(f"{prefix}.{n}" if prefix else n, getattr(m, n), pl) for prefix, m in model.named_modules()
            for n, pl in getattr(m, "state_placements", {}).items()]


def _barrier(mesh: Mesh) -> None:
    if mesh.group is not None:
        dist.barrier(group=mesh.group)


def begin(root: str | Path, step: int, mesh: Mesh) -> tuple[Path, Path]:
    """Create the (empty) temporary folder of a checkpoint; collective. Returns (tmp, final)."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(mesh)
    return tmp, final


def save(root: str | Path, step: int, model, optimizer, mesh: Mesh, meta: dict, keep_last: int = 0) -> Path:
    """Write and commit step_XXXXXXXX under root; collective over the mesh. Returns the final folder."""
    tmp, final = begin(root, step, mesh)
    written = _write_shard(tmp, model, optimizer, mesh)
    gathered = [written]
    if mesh.group is not None:
        gathered = [None] * mesh.world
        dist.all_gather_object(gathered, written, group=mesh.group)
    if mesh.rank == 0:
        commit(root, tmp, final, step, meta, gathered)
        prune(root, keep_last)
    _barrier(mesh)
    return final


def _write_shard(folder: Path, model, optimizer, mesh: Mesh) -> dict:
    """This rank's safetensors file; returns its tensor entries and the file's size and checksum."""
    tensors, entries = host_snapshot(model, optimizer, mesh, copy=False)
    return {"entries": entries, "file": write_file(folder, mesh.rank, tensors)}


def host_snapshot(model, optimizer, mesh: Mesh, copy: bool) -> tuple[dict, dict]:
    """(tensors on the host, metadata entries) of the slices this rank owns; `copy` detaches them from
    the live parameters so training may go on while they are written."""
    owned = _owned_tensors(model, optimizer, mesh)
    fname = f"shard_{mesh.rank:05d}.safetensors"
    tensors = {k: (t.detach().to("cpu", copy=True) if copy else t.detach().cpu()).contiguous()
               for k, (t, _) in owned.items()}
    entries = {k: {"file": fname, "dim": s.dim, "ranges": s.ranges(), "global_shape": list(s.global_shape),
                   "dtype": str(t.dtype).removeprefix("torch.")} for k, (t, s) in owned.items()}
    return tensors, entries


def write_file(folder: Path, rank: int, tensors: dict) -> tuple[str, dict] | None:
    """Write and fsync shard_<rank>.safetensors; returns (name, size and checksum)."""
    if not tensors:
        return None
    fname = f"shard_{rank:05d}.safetensors"
    save_file(tensors, str(folder / fname))
    # safety (issue 20): safetensors creates 0600 files; a checkpoint is shared like any output (umask rules)
    os.chmod(folder / fname, 0o666 & ~_UMASK)
    with open(folder / fname, "rb") as f:
        os.fsync(f.fileno())
    return fname, _file_info(folder / fname)


def _file_info(path: Path) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


def commit(root, tmp: Path, final: Path, step: int, meta: dict, gathered: list[dict]) -> None:
    """metadata.json last (fsynced), atomic rename of the folder, then the `latest` pointer."""
    tensors: dict[str, dict] = {}
    for part in gathered:
        for k, e in part["entries"].items():
            t = tensors.setdefault(k, {"global_shape": e["global_shape"], "dtype": e["dtype"], "shards": []})
            t["shards"].append({"file": e["file"], "dim": e["dim"], "ranges": e["ranges"]})
    files = dict(part["file"] for part in gathered if part["file"])
    _fsync_write(tmp / "metadata.json", json.dumps({"format": FORMAT, "step": step, **meta, "files": files,
                                                    "tensors": tensors}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_write(Path(root) / "latest.tmp", final.name + "\n")
    os.replace(Path(root) / "latest.tmp", Path(root) / "latest")


def committed(root: str | Path) -> list[Path]:
    """Committed step folders under root, oldest first."""
    if not Path(root).is_dir():
        return []
    return sorted(p for p in Path(root).glob("step_*")
                  if p.is_dir() and not p.name.endswith(".tmp") and (p / "metadata.json").is_file())


def prune(root: str | Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints of the current lineage (0 keeps everything)."""
    # safety (issue 20): by lineage, not by step number, so a rollback's new branch is never pruned
    from megaframe.checkpoint import lineage

    lineage.prune(root, keep_last)


def verify(path: str | Path) -> dict:
    """Metadata of a checkpoint whose files all have their recorded size and checksum; ValueError otherwise."""
    try:
        meta = read_metadata(path)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable metadata.json ({e})") from e
    for name, want in meta.get("files", {}).items():
        f = Path(path) / name
        if not f.is_file():
            raise ValueError(f"{path}: shard {name} is missing")
        got = _file_info(f)
        if got != want:
            raise ValueError(f"{path}: shard {name} is corrupt ({got['bytes']} bytes, crc32 {got['crc32']}; "
                             f"expected {want['bytes']} bytes, crc32 {want['crc32']})")
    return meta


def latest(root: str | Path, on_skip=None) -> Path | None:
    """The newest committed checkpoint under root that verifies, or None. `on_skip(path, reason)` hears
    about each newer one passed over because it is corrupt.

    A folder counts once its metadata.json exists (it is renamed into place whole), so a crash between
    the rename and the `latest` update loses nothing; `latest` is for people and scripts."""
    for path in committed(root)[::-1]:
        try:
            verify(path)
            return path
        except ValueError as e:
            if on_skip:
                on_skip(path, str(e))
    return None


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
        shard = p.placement.shard
        p.copy_(shard.local(load_full(path, f"model/{name}", meta)).to(p.device, p.dtype))
        if optimizer is None or f"optim/exp_avg/{name}" not in meta["tensors"]:
            continue
        # "master": fp32 master weights of a bf16 run (written by the ZeRO optimizer)
        moments = {k: shard.local(load_full(path, f"optim/{k}/{name}", meta))
                   for k in ("exp_avg", "exp_avg_sq", "master") if f"optim/{k}/{name}" in meta["tensors"]}
        optimizer.load_logical_state(p, moments, int(meta["step"]))
    for name, b, placement in state_buffers(model):  # absent in checkpoints of runs without it: keep the init value
        if f"model/{name}" in meta["tensors"]:
            b.copy_(placement.shard.local(load_full(path, f"model/{name}", meta)).to(b.device, b.dtype))
    return meta
