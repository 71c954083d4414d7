"""Who writes which bytes, and which bytes each rank needs: pure functions of the model's shards, the
optimizer's segments and the rank's coordinates (a meta model plans a 1000-rank layout in one process).

An `Item` is one logical tensor (model/<name>, optim/<kind>/<name>) as this rank holds it: flat ranges
of its local (tp/ep-sliced) tensor, held identically by `holders` ranks (dp replicas of a parameter, tp
replicas of a replicated one, 1 for a ZeRO segment). Each held range is cut in `holders` near-equal
parts and replica i writes part i (rows of a whole tensor, rotated by a hash of its key so small
tensors spread round-robin), so every rank writes about total/world bytes and no rank gathers state
it does not write.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

from megaframe.checkpoint.boxes import Box, flat_boxes, flat_span, shard_pieces, split_rows


@dataclass
class Item:
    key: str
    shard: object
    """This rank's Shard of the tensor (global shape, split dim, its ranges)."""
    dtype: str
    held: list[tuple[int, int]]
    """Flat ranges [lo, hi) of the local tensor this rank holds (all of it, or ZeRO segments)."""
    holders: int = 1
    index: int = 0
    sources: list = field(default_factory=list)
    """Runtime only: per held range, a 1-D tensor of exactly its elements (None when planning)."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.shard.local_shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def dtype_name(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def _replicas(p, mesh, segments: bool) -> tuple[int, int]:
    """(holders, my index) of p's local tensor (segments: of its ZeRO segments, already split over dp)."""
    # tp-replicated (norms, biases of row-parallel layers, experts unless folded over tp)
    tp_rep = "tp" in p.placement.replicated_over
    tp_n, tp_i = (mesh.tp.size, mesh.tp.rank) if tp_rep else (1, 0)
    if segments:  # ZeRO segments are this shard group's; under HSDP the dp_rep ranks hold them too
        rep = mesh.edp_rep if p.placement.expert else mesh.dp_rep
        if rep is None or rep.size == 1:
            return tp_n, tp_i
        return tp_n * rep.size, rep.rank * tp_n + tp_i  # tp innermost: a distinct part per holder
    # an expert's replicas are its expert-data-parallel ranks: the ep ranks beside them hold other experts
    dp = (mesh.edp or mesh.dp) if p.placement.expert else mesh.dpcp  # dense: replicated over cp·dp
    return dp.size * tp_n, dp.rank * tp_n + tp_i


def state_buffers(model) -> list[tuple[str, torch.Tensor, object]]:
    """(global name, tensor, Placement) of buffers that are model state, saved and loaded like parameters.
    A module declares them in `state_placements` ({buffer name: Placement}): a tag on the tensor itself
    would be lost when model.to() replaces buffers."""
    return [
        (f"{prefix}.{n}" if prefix else n, getattr(m, n), pl)
        for prefix, m in model.named_modules()
        for n, pl in getattr(m, "state_placements", {}).items()
    ]


def _weight_item(name, p, optimizer, mesh, with_sources: bool) -> tuple[Item, list | None]:
    """The model/ item of parameter p, and its ZeRO-3 weight segments (None when p is held whole)."""
    weights = optimizer.weight_segments(p) if hasattr(optimizer, "weight_segments") else None
    if weights is not None:  # ZeRO-3: the params are sharded too; each rank writes its own segments
        h, i = _replicas(p, mesh, segments=True)
        return Item(
            f"model/{name}",
            p.placement.shard,
            dtype_name(p.dtype),
            [(lo, lo + n) for lo, n, _ in weights],
            h,
            i,
            [t for *_, t in weights] if with_sources else [],
        ), weights
    h, i = _replicas(p, mesh, segments=False)
    return Item(
        f"model/{name}",
        p.placement.shard,
        dtype_name(p.dtype),
        [(0, p.numel())],
        h,
        i,
        [p.detach().reshape(-1)] if with_sources else [],
    ), None


def _optimizer_items(name, p, optimizer, mesh, with_sources: bool, weights) -> list[Item]:
    """The optim/<kind>/ items of parameter p: its ZeRO segments of each state the update rule keeps (and the
    master), or its whole state. The kinds are the segments' own: the rule names them, not this file."""
    items = []
    segs = optimizer.state_segments(p) if hasattr(optimizer, "state_segments") else None
    if segs is not None:  # ZeRO: this dp rank's segments, replicated over tp only
        h, i = _replicas(p, mesh, segments=True)
        for kind in dict.fromkeys(k for _, _, st in segs for k in st):
            if kind == "master" and weights is not None and p.dtype == torch.float32:
                continue  # ZeRO-3's fp32 weights above are its master, bit for bit: not written twice
            parts = [(lo, n, st[kind]) for lo, n, st in segs if kind in st]
            if parts:
                # the state's own dtype (optim.state_dtype; the master fp32): the checkpoint records it
                items.append(
                    Item(
                        f"optim/{kind}/{name}",
                        p.placement.shard,
                        dtype_name(parts[0][2].dtype),
                        [(lo, lo + n) for lo, n, _ in parts],
                        h,
                        i,
                        [t for _, _, t in parts] if with_sources else [],
                    )
                )
        return items
    h, i = _replicas(p, mesh, segments=False)
    for kind, t in optimizer.logical_state(p).items():
        items.append(
            Item(
                f"optim/{kind}/{name}",
                p.placement.shard,
                dtype_name(t.dtype),
                [(0, p.numel())],
                h,
                i,
                [t.detach().reshape(-1)] if with_sources else [],
            )
        )
    return items


def _buffer_items(model, mesh, with_sources: bool) -> list[Item]:
    """The model/ items of the state buffers (state_buffers)."""
    items = []
    for name, b, pl in state_buffers(model):
        # a state buffer is replicated over tp and cp·dp: that stage's tp x cp·dp ranks share its write
        h, i = mesh.tp.size * mesh.dpcp.size, mesh.dpcp.rank * mesh.tp.size + mesh.tp.rank
        items.append(
            Item(
                f"model/{name}",
                pl.shard,
                dtype_name(b.dtype),
                [(0, b.numel())],
                h,
                i,
                [b.detach().reshape(-1)] if with_sources else [],
            )
        )
    return items


def param_items(model, optimizer, mesh, with_sources: bool) -> list[Item]:
    """Every logical tensor of this rank's model and optimizer state, with its holders."""
    items = []
    for name, p in model.named_parameters():
        if p.placement.pp_duplicate:  # the tied embedding's copy: stage 0 holds the same tensor
            continue
        weight, weights = _weight_item(name, p, optimizer, mesh, with_sources)
        items.append(weight)
        items += _optimizer_items(name, p, optimizer, mesh, with_sources, weights)
    return items + _buffer_items(model, mesh, with_sources)


@dataclass
class Stored:
    """One tensor of this rank's file: elements [lo, hi) of an item's local tensor, a box of it."""

    key: str
    stored_key: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    pieces: list[tuple[Box, Box]]
    """(box of the stored tensor, box of the global tensor) per fused block it crosses."""
    dtype: str = "float32"
    global_shape: tuple[int, ...] = ()
    source: object = None


def my_writes(items: list[Item]) -> list[Stored]:
    """The stored tensors this rank writes: its part of every held range, cut into boxes."""
    out = []
    for it in items:
        # the replicas must agree on the rotation: a function of the key only (not of list positions,
        # which differ where a ZeRO rank holds no segment of some parameter)
        ordinal = zlib.crc32(it.key.encode())
        shape = it.local_shape
        k = 1  # cut on boundaries of the first k dims, enough of them to give every holder a part
        while k < len(shape) and math.prod(shape[:k]) < it.holders:
            k += 1
        rows, inner = math.prod(shape[:k]), math.prod(shape[k:])
        count = 0
        for (lo, hi), src in zip(it.held, it.sources or [None] * len(it.held)):
            if it.holders == 1:
                a, b = lo, hi
            elif (lo, hi) == (0, math.prod(shape)):  # a whole tensor: cut on row boundaries
                r0, r1 = split_rows(rows, it.holders, ordinal)[it.index]
                a, b = r0 * inner, r1 * inner
            # a ZeRO segment is a flat range, not whole rows: cut it on element boundaries
            else:
                c0, c1 = split_rows(hi - lo, it.holders, ordinal)[it.index]
                a, b = lo + c0, lo + c1
            for box in flat_boxes(shape, a, b):
                first, _ = flat_span(shape, box)
                size = tuple(h - l for l, h in box)
                pieces = [
                    (tuple((pl - bl, ph - bl) for (pl, ph), (bl, _) in zip(local, box)), glob)
                    for local, glob in shard_pieces(box, it.shard)
                ]
                n = math.prod(size)
                data = None if src is None else src[first - lo : first - lo + n].view(size)
                out.append(
                    Stored(
                        it.key,
                        f"{it.key}#{count}",
                        size,
                        first,
                        first + n,
                        pieces,
                        it.dtype,
                        tuple(it.shard.global_shape),
                        data,
                    )
                )
                count += 1
    return out


def needs(items: list[Item]) -> dict[str, list[tuple[Box, Box]]]:
    """key -> (local box, global box) pairs this rank must read: every held element, exactly once."""
    out: dict[str, list[tuple[Box, Box]]] = {}
    for it in items:
        pairs = out.setdefault(it.key, [])
        for lo, hi in it.held:
            for box in flat_boxes(it.local_shape, lo, hi):
                pairs += shard_pieces(box, it.shard)
    return out


def share_bytes(items: list[Item]) -> int:
    return sum((hi - lo) * it.itemsize for it in items for lo, hi in it.held)
