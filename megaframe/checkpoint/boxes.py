"""Index geometry of checkpoint slices: boxes (one [lo, hi) per dim) of local and global tensors.

Everything a rank writes or reads is a set of flat ranges of its local tensor (the whole tensor, a
dp chunk of its rows, or a ZeRO segment). A flat range of a row-major tensor is a few boxes
(`flat_boxes`), and a box of a local slice is a few boxes of the global tensor (`to_global`: one per
fused block along the split dim). Pure integer arithmetic: no tensors, so plans of a 1000-rank
layout are computed in one process.
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, int], ...]


def volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes (in row-major order) covering elements [lo, hi) of a tensor of `shape`: at most 2·ndim - 1."""
    if lo >= hi:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)
    if r0 == r1:
        return [((r0, r0 + 1),) + b for b in flat_boxes(shape[1:], c0, c1)]
    out: list[Box] = []
    # a partial first row, then the whole rows as one box, then a partial last row: at most 2·ndim - 1 boxes
    if c0:
        out += [((r0, r0 + 1),) + b for b in flat_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1),) + tuple((0, n) for n in shape[1:]))
    if c1:
        out += [((r1, r1 + 1),) + b for b in flat_boxes(shape[1:], 0, c1)]
    return out


def to_global(box: Box, dim: int | None, ranges: list[tuple[int, int, int]]) -> list[tuple[Box, Box]]:
    """(local box, global box) pieces of a box of a local slice whose split dim `dim` holds `ranges`
    ((global offset, local offset, length) per fused block); dim None: the tensor is whole."""
    if dim is None:
        return [(box, box)]
    out = []
    lo, hi = box[dim]
    for g, l, n in ranges:
        a, b = max(lo, l), min(hi, l + n)
        if a < b:
            local = box[:dim] + ((a, b),) + box[dim + 1 :]
            out.append((local, box[:dim] + ((g + a - l, g + b - l),) + box[dim + 1 :]))
    return out


def shard_pieces(box: Box, shard) -> list[tuple[Box, Box]]:
    """to_global for a layers.shard.Shard, its inner split included (stacked experts under etp: the
    local box goes through the inner split's dim first, then the outer split's)."""
    outer = [] if shard.dim is None else shard.ranges()
    if shard.inner is None:
        return to_global(box, shard.dim, outer)
    d = shard.inner.dim
    out = []
    for local, mid in to_global(box, d, shard.inner.ranges()):
        # the outer split leaves dim d alone: a piece of `mid` is the same piece of `local` there
        pieces = to_global(mid, shard.dim, outer)
        out += [(part[:d] + (local[d],) + part[d + 1 :], glob) for part, glob in pieces]
    return out


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def shift(box: Box, frm: Box, to: Box) -> Box:
    """`box` (inside `frm`) moved to the same place relative to `to`."""
    return tuple((lo - f + t, hi - f + t) for (lo, hi), (f, _), (t, _) in zip(box, frm, to))


def flat_span(shape: tuple[int, ...], box: Box) -> tuple[int, int]:
    """[first, last + 1) flat indices of a box in a row-major tensor: the bytes to read to get it."""
    first = last = 0
    for (lo, hi), n in zip(box, shape):
        first, last = first * n + lo, last * n + hi - 1  # hi - 1: the box's last element
    return first, last + 1


def split_rows(rows: int, parts: int, rotate: int = 0) -> list[tuple[int, int]]:
    """Part j of `rows` split in `parts` near-equal contiguous chunks, for j = 0..parts-1, where the
    larger chunks go to the parts after `rotate` (so small tensors do not all land on part 0)."""
    base, extra = divmod(rows, parts)
    # replicas agree on the cut: `rotate` comes from the tensor's key, never from rank-local state
    sizes = [base + (1 if (j - rotate) % parts < extra else 0) for j in range(parts)]
    out, at = [], 0
    for s in sizes:
        out.append((at, at + s))
        at += s
    return out
