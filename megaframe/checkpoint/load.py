"""Loading by read plans: each rank reads only the byte ranges its slices (and ZeRO segments) need,
opening each file once, checking every block it reads against its crc32.

`load_newest` is resume=auto's loader: newest complete checkpoint first; if any rank fails to load it
(a corrupt block), every rank hears so and all fall back to the previous one together.
"""
from __future__ import annotations

import math
import time
import zlib
from pathlib import Path

import torch

from megaframe.checkpoint.layout import Item, needs, state_buffers
from megaframe.checkpoint.metadata import (
    CheckpointError,
    check_complete,
    check_coverage,
)
from megaframe.checkpoint.plan import Index, plan_reads
from megaframe.checkpoint.store import ReadStats, read_ranges
from megaframe.parallel import comm

# RuntimeErrors that stop a load without saying anything about the checkpoint (torch 2.13 has all three; an older
# torch may lack AcceleratorError)
_NOT_THE_CHECKPOINT = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None),
                                        getattr(torch.distributed, "DistError", None)) if t is not None)


def not_the_checkpoints_fault(e: BaseException) -> bool:
    """Out of memory (host or device), an accelerator fault or a collective backend error: the machine stopped the
    load, the checkpoint may be fine. Loaders must not skip the checkpoint for it (no fall-back to an older one)."""
    return isinstance(e, (MemoryError, *_NOT_THE_CHECKPOINT))


class LoadStopped(Exception):
    """A load stopped by something other than the checkpoint (not_the_checkpoints_fault) on some rank: raised on every
    rank by load_agreed, so load_newest does not fall back past a checkpoint that may be fine."""


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # 4 MiB chunks: a whole-file crc without the file in memory
            crc = zlib.crc32(chunk, crc)
    return crc


def load_items(model, optimizer, meta: dict) -> list[Item]:
    """What this rank needs: each parameter's local slice, and its optimizer state (ZeRO: its segments)."""
    have, items = meta["tensors"], []
    for name, p in model.named_parameters():
        whole = [(0, p.numel())]
        items.append(Item(f"model/{name}", p.placement.shard, have[f"model/{name}"]["dtype"] if f"model/{name}" in have
                          else "float32", whole))
        if optimizer is None or f"optim/exp_avg/{name}" not in have:
            continue
        segs = optimizer.state_segments(p) if hasattr(optimizer, "state_segments") else None
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            key = f"optim/{kind}/{name}"
            if key not in have:
                continue
            # a ZeRO rank needs its segments only; the master of an fp32 target is copied into the whole param
            mine = whole if segs is None or (kind == "master" and not any("master" in s for *_, s in segs)) \
                else [(lo, lo + n) for lo, n, _ in segs]
            items.append(Item(key, p.placement.shard, have[key]["dtype"], mine))
    for name, b, pl in state_buffers(model):
        shard = pl.shard
        if f"model/{name}" in have:  # absent in checkpoints of runs without it: keep the init value
            items.append(Item(f"model/{name}", shard, have[f"model/{name}"]["dtype"], [(0, b.numel())]))
    return items


def execute(path: Path, meta: dict, plan, index, out: dict[str, torch.Tensor], stats: ReadStats) -> None:
    """Read the plan's ranges (each file opened once) and copy each piece into out[key]."""
    by_stored: dict[int, list] = {}
    for key, sid, src, dst, size in plan.copies:
        for i in range(len(sid)):
            by_stored.setdefault(int(sid[i]), []).append((key, src[i].tolist(), dst[i].tolist(), size[i].tolist()))
    sid_of = {(f, k): i for i, (f, k, _) in enumerate(index.stored)}
    files = meta.get("files", {})
    v1 = "v1_files" in meta
    for name, reads in plan.reads.items():
        want = None if v1 else files.get(name, {}).get("header_crc32")  # v1 recorded no header crc
        for skey, first, data in read_ranges(path, name, reads, want, stats, check=not v1):
            sid = sid_of[(name, skey)]
            shape = index.stored[sid][2]
            strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
            for key, src, dst, size in by_stored[sid]:
                at = sum(lo * s for lo, s in zip(src, strides))
                last = at + sum((n - 1) * s for n, s in zip(size, strides)) + 1
                if at < first or last > first + data.numel():
                    continue  # the piece lies in another merged range of this stored tensor
                view = out[key]
                for d, (lo, n) in enumerate(zip(dst, size)):
                    view = view.narrow(d, lo, n)
                view.copy_(data.as_strided(size, strides, at - first))


def read_items(path: str | Path, meta: dict, items: list[Item]) -> tuple[dict[str, torch.Tensor], dict]:
    """{key: local tensor (only the needed ranges filled)} and this rank's read figures."""
    t0 = time.perf_counter()
    check_coverage({k: meta["tensors"][k] for k in {it.key for it in items}})
    need = needs(items)
    index = Index(meta["tensors"])
    plan = plan_reads(index, need)
    # zeros, not empty: only the held ranges are read (a ZeRO rank's segments); the rest must hold a defined value
    out = {it.key: torch.zeros(it.local_shape, dtype=getattr(torch, it.dtype)) for it in items}
    stats = ReadStats()
    execute(Path(path), meta, plan, index, out, stats)
    return out, {"read_bytes": stats.bytes, "read_data_bytes": stats.data_bytes, "needed_bytes": plan.needed_bytes,
                 "planned_bytes": plan.planned_bytes,
                 "files_opened": stats.files, "load_s": time.perf_counter() - t0}


def load_full(path: str | Path, key: str, meta: dict) -> torch.Tensor:
    """One whole logical tensor (export, tests)."""
    from megaframe.layers.shard import Shard

    info = meta["tensors"][key]
    n = math.prod(info["global_shape"])
    item = Item(key, Shard(tuple(info["global_shape"])), info["dtype"], [(0, n)])
    return read_items(path, meta, [item])[0][key]


@torch.no_grad()
def load_into(path: str | Path, model, optimizer=None) -> dict:
    """Fill this rank's parameter (and optimizer state) slices from a checkpoint of any layout; returns
    its metadata, with this rank's read figures under "io_load"."""
    meta = check_complete(path)
    items = load_items(model, optimizer, meta)
    got, figures = read_items(path, meta, items)
    for name, p in model.named_parameters():
        # cast: the checkpoint may hold another dtype than this run's params (a bf16 run resumed in fp32)
        p.copy_(got[f"model/{name}"].to(p.device, p.dtype))
        moments = {k: got[f"optim/{k}/{name}"] for k in ("exp_avg", "exp_avg_sq", "master")
                   if f"optim/{k}/{name}" in got}
        if moments:
            optimizer.load_logical_state(p, moments, int(meta["step"]))
    for name, b, _ in state_buffers(model):
        if f"model/{name}" in got:
            b.copy_(got[f"model/{name}"].to(b.device, b.dtype))
    meta["io_load"] = figures
    return meta


def load_agreed(path: Path, model, optimizer, mesh) -> tuple[dict | None, str | None]:
    """load_into on every rank; (meta, None) if all succeeded, else (None, the first failure) on all."""
    meta, err, stop = None, None, None
    try:
        meta = load_into(path, model, optimizer)
    except (CheckpointError, OSError, KeyError, RuntimeError, MemoryError) as e:
        err = f"rank {mesh.rank}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        stop = not_the_checkpoints_fault(e)
    # every rank reaches the gather, failed or not, so all return the same verdict and fall back (or stop) together
    outcomes = comm.gather_objects((err, stop), mesh.group)
    stopped = [e for e, s in outcomes if s]
    if stopped:
        raise LoadStopped(f"loading checkpoint {path} failed: {stopped[0]} (not a fault of the checkpoint)")
    errors = [e for e, _ in outcomes if e]
    return (meta, None) if not errors else (None, errors[0])


def load_newest(root: str | Path, model, optimizer, mesh, on_skip=None) -> tuple[Path | None, dict | None]:
    """Load the newest checkpoint under root that every rank loads; (None, None) if there is none."""
    from megaframe.checkpoint.metadata import committed

    for path in committed(root)[::-1]:
        try:
            # every rank checks the same shared files, so all skip the same folders before the collective load
            check_complete(path)
        except CheckpointError as e:
            if on_skip:
                on_skip(path, str(e))
            continue
        meta, err = load_agreed(path, model, optimizer, mesh)
        if meta is not None:
            return path, meta
        if on_skip:
            on_skip(path, err)
    return None, None
