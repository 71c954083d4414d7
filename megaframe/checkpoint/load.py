"""Loading by read plans: each rank reads only the byte ranges its slices (and ZeRO segments) need,
opening each file once, checking every block it reads against its crc32.

Every piece read goes straight into its destination (a `Sink`): the parameter itself, on its device, and the
optimizer's own state (a ZeRO rank: the flat owned segments of its rule's state and master; zero=0: its state,
made at their final size). No tensor of a parameter's full local shape is made on the way, so the host memory
a load adds is the rank's share where it lives on the host, plus one staging buffer per file being read, of at
most `staging_bytes` (checkpoint/store.py: STAGING_BYTES = 64 MiB by default): a ZeRO rank's moments are never
held whole. `megaframe.load_model` (no optimizer) reads no optimizer state at all: its memory is the model's.

`load_newest` is resume=auto's loader: newest complete checkpoint first; if any rank fails to load it
(a corrupt block), every rank hears so and all fall back to the previous one together. An out-of-memory,
accelerator or collective error is not the checkpoint's fault (`not_the_checkpoints_fault`): it stops the load
on every rank (LoadStopped) instead.
"""

from __future__ import annotations

import bisect
import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from megaframe.checkpoint.boxes import flat_boxes, intersect
from megaframe.checkpoint.layout import Item, needs, state_buffers
from megaframe.checkpoint.metadata import (
    CheckpointError,
    check_complete,
    check_coverage,
)
from megaframe.checkpoint.read_plan import Index, plan_reads
from megaframe.checkpoint.store import STAGING_BYTES, ReadStats, read_ranges
from megaframe.config.schema import OptimConfig
from megaframe.parallel import comm

# RuntimeErrors that stop a load without saying anything about the checkpoint (torch 2.13 has all three; an
# older torch may lack AcceleratorError)
_NOT_THE_CHECKPOINT = tuple(
    t
    for t in (
        getattr(torch, "OutOfMemoryError", None),
        getattr(torch, "AcceleratorError", None),
        getattr(torch.distributed, "DistError", None),
    )
    if t is not None
)


def not_the_checkpoints_fault(e: BaseException) -> bool:
    """Out of memory (host or device), an accelerator fault or a collective backend error: the machine stopped
    the load, the checkpoint may be fine. Loaders must not skip the checkpoint for it (no fall-back to an
    older one)."""
    return isinstance(e, (MemoryError, *_NOT_THE_CHECKPOINT))


class LoadStopped(Exception):
    """A load stopped by something other than the checkpoint (not_the_checkpoints_fault) on some rank: raised
    on every rank by load_agreed, so load_newest does not fall back past a checkpoint that may be fine."""


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # 4 MiB chunks: a whole-file crc without the file in memory
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass
class Sink:
    """Where one logical tensor's held elements land: `windows` of (lo, hi, 1-D tensor holding elements [lo,
    hi) of the flat local tensor of `shape`), any dtype and device (each copy casts)."""

    shape: tuple[int, ...]
    windows: list[tuple[int, int, torch.Tensor]]

    def __post_init__(self):
        self.windows.sort(key=lambda w: w[0])
        self._los = [lo for lo, _, _ in self.windows]
        self._strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]

    @classmethod
    def whole(cls, t: torch.Tensor) -> "Sink":
        # detach keeps the version counter: an optimizer sees
        # the param written (ZeRO's master resync relies on it)
        return cls(tuple(t.shape), [(0, t.numel(), t.detach().view(-1))])  # view: a param is contiguous

    def put(self, dst: list[int], size: list[int], src: torch.Tensor) -> None:
        """Copy src (a box of `size`) to the box at dst of the local tensor (inside one window: the plan's
        boxes are cut from the held ranges)."""
        at = sum(lo * s for lo, s in zip(dst, self._strides))
        lo, hi, t = self.windows[bisect.bisect_right(self._los, at) - 1]
        end = at + sum((n - 1) * s for n, s in zip(size, self._strides)) + 1
        if not (lo <= at and end <= hi):
            raise CheckpointError(f"a piece of elements {at}..{end} falls outside the held range {lo}..{hi}")
        t.as_strided(size, self._strides, t.storage_offset() + at - lo).copy_(src)


def load_targets(model, optimizer, meta: dict) -> tuple[list[Item], dict[str, Sink], list]:
    """What this rank needs and where each lands: each parameter's local slice (into the parameter) and its
    optimizer state (into the optimizer's own: ZeRO, its segments); and the optimizer's calls to make once all
    is read."""
    have, items, sinks, done = meta["tensors"], [], {}, []
    # the update rule names the state; the master is the strategy's fp32 copy. A checkpoint of another rule
    # (checkpoint.allow_config_change=[optim.name]) gives the weights only: the new rule's state starts
    # fresh (its step count too). Older checkpoints record no rule: the default's (the only one then).
    saved_rule = ((meta.get("config") or {}).get("optim") or {}).get("name", OptimConfig.name)
    own = optimizer is not None and saved_rule == optimizer.rule.name
    kinds = (*optimizer.rule.states, "master") if own else ()

    def want(key: str, shard, held, sink: Sink) -> None:
        items.append(Item(key, shard, have[key]["dtype"] if key in have else "float32", held))
        sinks[key] = sink

    for name, p in model.named_parameters():
        whole = [(0, p.numel())]
        segs, state_master = None, False
        # the names this kind of parameter holds (Muon: momentum on hidden matrices, moments on the rest)
        names = optimizer.rule.states_for(p.placement) if own else ()
        if names and f"optim/{names[0]}/{name}" in have:
            segs, state_master = optimizer.load_targets(p)
        # ZeRO-3, a block not gathered now: p's value lives only in this rank's segments of its master
        home = optimizer.param_home(p) if hasattr(optimizer, "param_home") else None
        # an optimizer without a master of p (fp32 params) takes the saved master, the more exact, as p itself
        master_is_p = segs is not None and not state_master and f"optim/master/{name}" in have
        if home is not None:
            if segs is None or f"optim/master/{name}" not in have:  # else the saved master fills the segments
                want(
                    f"model/{name}",
                    p.placement.shard,
                    [(lo, lo + n) for lo, n, _ in home],
                    Sink(tuple(p.shape), [(lo, lo + n, t) for lo, n, t in home]),
                )
        elif not master_is_p:  # else the master below fills p
            want(f"model/{name}", p.placement.shard, whole, Sink.whole(p))
        if segs is None:
            continue
        for kind in kinds:
            key = f"optim/{kind}/{name}"
            if kind == "master" and master_is_p:
                want(key, p.placement.shard, whole, Sink.whole(p))
            elif key in have and segs and kind in segs[0][2]:
                want(
                    key,
                    p.placement.shard,
                    [(lo, lo + n) for lo, n, _ in segs],
                    Sink(tuple(p.shape), [(lo, lo + n, st[kind]) for lo, n, st in segs]),
                )
        loaded = {k for k in kinds if f"optim/{k}/{name}" in have}
        done.append(lambda p=p, loaded=loaded: optimizer.loaded(p, loaded, int(meta["step"])))
    for name, b, pl in state_buffers(model):
        if f"model/{name}" in have:  # absent in checkpoints of runs without it: keep the init value
            want(f"model/{name}", pl.shard, [(0, b.numel())], Sink.whole(b))
    return items, sinks, done


def execute(
    path: Path,
    meta: dict,
    plan,
    index,
    sinks: dict[str, Sink],
    stats: ReadStats,
    staging_bytes: int = STAGING_BYTES,
) -> None:
    """Read the plan's ranges (each file opened once, through one bounded staging buffer) and copy each piece
    into its sink."""
    by_stored: dict[int, list] = {}
    for key, sid, src, dst, size in plan.copies:
        for i in range(len(sid)):
            by_stored.setdefault(int(sid[i]), []).append(
                (key, src[i].tolist(), dst[i].tolist(), size[i].tolist())
            )
    sid_of = {(f, k): i for i, (f, k, _) in enumerate(index.stored)}
    files = meta.get("files", {})
    v1 = "v1_files" in meta
    for name, reads in plan.reads.items():
        want = None if v1 else files.get(name, {}).get("header_crc32")  # v1 recorded no header crc
        for skey, first, data in read_ranges(path, name, reads, want, stats, not v1, staging_bytes):
            sid = sid_of[(name, skey)]
            _scatter(data, first, index.stored[sid][2], by_stored[sid], sinks)
        # drop the last chunk's view: it would keep this file's
        # staging buffer alive while the next file's is made
        data = None  # noqa: F841


def _scatter(data: torch.Tensor, first: int, shape: tuple, pieces: list, sinks: dict[str, Sink]) -> None:
    """Copy the parts of `pieces` ((key, src lo, dst lo, size) boxes of a stored tensor of `shape`) that lie
    in `data` (its elements [first, first + n), a view of the staging buffer) into their sinks."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    c1 = first + data.numel()
    base = data.storage_offset()  # a view of the staging buffer: as_strided offsets are absolute
    for key, src, dst, size in pieces:
        at = sum(lo * s for lo, s in zip(src, strides))
        last = at + sum((n - 1) * s for n, s in zip(size, strides)) + 1
        if last <= first or at >= c1:
            continue  # the piece lies in another chunk, or another merged range, of this stored tensor
        if first <= at and last <= c1:
            sinks[key].put(dst, size, data.as_strided(size, strides, base + at - first))
            continue
        # a piece cut by the chunk's ends: its part inside the chunk is a few boxes
        piece = tuple((lo, lo + n) for lo, n in zip(src, size))
        for box in flat_boxes(shape, max(at, first), min(last, c1)):
            part = intersect(box, piece)
            if part is None:
                continue
            part_size = [hi - lo for lo, hi in part]
            off = base + sum(lo * s for (lo, _), s in zip(part, strides)) - first
            to = [d + lo - s for d, (lo, _), s in zip(dst, part, src)]
            sinks[key].put(to, part_size, data.as_strided(part_size, strides, off))


def read_items(
    path: str | Path,
    meta: dict,
    items: list[Item],
    sinks: dict[str, Sink] | None = None,
    staging_bytes: int = STAGING_BYTES,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Read every item's held ranges into its sink; without sinks, into new zero-filled local tensors,
    returned as {key: tensor} (load_full: the whole tensor is what is asked for). Also this rank's read
    figures."""
    t0 = time.perf_counter()
    check_coverage({k: meta["tensors"][k] for k in {it.key for it in items}})
    index = Index(meta["tensors"])
    plan = plan_reads(index, needs(items))
    out = {}
    if sinks is None:
        out = {it.key: torch.zeros(it.local_shape, dtype=getattr(torch, it.dtype)) for it in items}
        sinks = {k: Sink.whole(t) for k, t in out.items()}
    stats = ReadStats()
    execute(Path(path), meta, plan, index, sinks, stats, staging_bytes)
    return out, {
        "read_bytes": stats.bytes,
        "read_data_bytes": stats.data_bytes,
        "needed_bytes": plan.needed_bytes,
        "planned_bytes": plan.planned_bytes,
        "files_opened": stats.files,
        "load_s": time.perf_counter() - t0,
    }


def load_full(path: str | Path, key: str, meta: dict) -> torch.Tensor:
    """One whole logical tensor (export, tests)."""
    from megaframe.layers.shard import Shard

    info = meta["tensors"][key]
    n = math.prod(info["global_shape"])
    item = Item(key, Shard(tuple(info["global_shape"])), info["dtype"], [(0, n)])
    return read_items(path, meta, [item])[0][key]


@torch.no_grad()
def load_into(path: str | Path, model, optimizer=None, staging_bytes: int = STAGING_BYTES) -> dict:
    """Fill this rank's parameter (and optimizer state) slices from a checkpoint of any layout, in place (see
    the module docstring); returns its metadata, with this rank's read figures under "io_load"."""
    meta = check_complete(path)
    items, sinks, done = load_targets(model, optimizer, meta)
    _, figures = read_items(path, meta, items, sinks, staging_bytes)
    for finish in done:  # after every read: the optimizer may derive state from the loaded params
        finish()
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
    # every rank reaches the gather, failed or not, so all
    # return the same verdict and fall back (or stop) together
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
