"""The read planner: a pure function of (checkpoint metadata, what this rank needs) giving the byte
ranges of each file to read and where each piece goes. It reads no tensor data, so every rank of a
1000-rank loading layout can be planned in one process (tests/unit/checkpoint/test_checkpoint_plan.py).

Boxes are numpy rows ([n, ndim] lo and hi arrays): a needed box is intersected with all stored pieces
of its tensor at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from megaframe.checkpoint.boxes import Box
from megaframe.checkpoint.metadata import CheckpointError


@dataclass
class Pieces:
    """The stored pieces of one logical tensor: global box (lo, hi), stored-box origin (llo), the stored
    tensor's row-major strides, and which stored tensor (sid, an index into Index.stored)."""

    lo: np.ndarray
    hi: np.ndarray
    llo: np.ndarray
    stride: np.ndarray
    sid: np.ndarray
    itemsize: int


class Index:
    """Per logical tensor, its stored pieces as arrays, built once per metadata and shared by ranks."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.stored: list[tuple[str, str, tuple]] = []  # (file, stored key, stored shape)
        self._sid: dict[tuple[str, str], int] = {}
        self._by_key: dict[str, Pieces] = {}

    def pieces(self, key: str) -> Pieces:
        if key not in self._by_key:
            info = self.tensors.get(key)
            if info is None:
                raise CheckpointError(f"the checkpoint has no tensor {key}")
            nd = len(info["global_shape"])
            lo, hi, llo, stride, sid = [], [], [], [], []
            for s in info["shards"]:
                ident = (s["file"], s["key"])
                if ident not in self._sid:
                    self._sid[ident] = len(self.stored)
                    self.stored.append((s["file"], s["key"], tuple(s["shape"])))
                shape = s["shape"]
                st = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
                for local, glob in s["pieces"]:
                    lo.append([a for a, _ in glob])
                    hi.append([b for _, b in glob])
                    llo.append([a for a, _ in local])
                    stride.append(st)
                    sid.append(self._sid[ident])
            # reshape: a tensor with no pieces still gives [0, nd] arrays, so the coverage check reports it
            arr = lambda x: np.array(x, dtype=np.int64).reshape(-1, nd)  # an empty list still gives [0, nd]
            size = torch.empty((), dtype=getattr(torch, info["dtype"])).element_size()
            self._by_key[key] = Pieces(
                arr(lo), arr(hi), arr(llo), arr(stride), np.array(sid, dtype=np.int64), size
            )
        return self._by_key[key]


@dataclass
class Plan:
    reads: dict = field(default_factory=dict)
    """file -> [(stored key, first element, last element)], ranges merged per stored tensor."""
    copies: list = field(default_factory=list)
    """(key, sid array, src lo, dst lo, size) per logical tensor: piece i copies the box of `size[i]`
    at src_lo[i] of stored tensor sid[i] to dst_lo[i] of this rank's local tensor."""
    needed_bytes: int = 0
    planned_bytes: int = 0


def plan_reads(index: Index, need: dict[str, list[tuple[Box, Box]]]) -> Plan:
    """The reads and copies that give this rank every (local box, global box) it needs exactly once.
    CheckpointError when the checkpoint does not cover a needed box exactly once."""
    plan = Plan()
    spans_sid, spans_first, spans_last, sizes = [], [], [], []
    for key, pairs in need.items():
        pc = index.pieces(key)
        if not pairs:  # a ZeRO rank holding no segment of this parameter
            continue
        boxes = np.array(pairs, dtype=np.int64)  # [m, 2 (local, global), nd, 2 (lo, hi)]
        l_lo, g_lo, g_hi = boxes[:, 0, :, 0], boxes[:, 1, :, 0], boxes[:, 1, :, 1]
        # every needed box against every stored piece of the tensor at once: [m, n]
        hit = np.all((pc.lo[None] < g_hi[:, None]) & (pc.hi[None] > g_lo[:, None]), axis=2)
        i, j = np.nonzero(hit)
        p_lo, p_hi = np.maximum(pc.lo[j], g_lo[i]), np.minimum(pc.hi[j], g_hi[i])
        size = p_hi - p_lo
        # elements covered per needed box; a gap and an overlap of the same size would cancel, but read_items'
        # check_coverage has already refused overlaps
        # elements covered per needed box; a gap and an overlap of the same size would cancel, but read_items'
        # check_coverage has already refused overlaps
        got = np.bincount(i, weights=np.prod(size, axis=1), minlength=len(boxes))
        want = np.prod(g_hi - g_lo, axis=1)
        bad = np.nonzero(got != want)[0]
        if len(bad):
            k = int(bad[0])
            raise CheckpointError(
                f"tensor {key}: the checkpoint holds {int(got[k])} of the {int(want[k])} "
                f"elements of {boxes[k, 1].tolist()} this rank needs "
                f"({'a gap' if got[k] < want[k] else 'overlapping shards'})"
            )
        src = p_lo - pc.lo[j] + pc.llo[j]
        dst = p_lo - g_lo[i] + l_lo[i]
        plan.copies.append((key, pc.sid[j], src, dst, size))
        first = (src * pc.stride[j]).sum(axis=1)
        spans_first.append(first)
        spans_last.append(first + ((size - 1) * pc.stride[j]).sum(axis=1) + 1)
        spans_sid.append(pc.sid[j])
        sizes.append(np.full(len(j), pc.itemsize, dtype=np.int64))
        plan.needed_bytes += int(want.sum()) * pc.itemsize
    if spans_sid:
        _merge_into(plan, index, *[np.concatenate(x) for x in (spans_sid, spans_first, spans_last, sizes)])
    return plan


def _merge_into(plan: Plan, index: Index, sid, first, last, itemsize) -> None:
    """Merge overlapping element ranges per stored tensor into the reads (vectorised)."""
    order = np.lexsort((first, sid))
    sid, first, last, itemsize = sid[order], first[order], last[order], itemsize[order]
    big = np.int64(1) << 40  # stored tensors have fewer elements: ranges of different ones never merge
    a, b = sid * big + first, sid * big + last
    reach = np.maximum.accumulate(b)
    start = np.ones(len(a), dtype=bool)
    # a read starts where a range begins past the furthest end before it; touching ranges (a == reach) merge
    # into one read a read starts where a range begins past the furthest end before it; touching ranges (a ==
    # reach) merge into one read
    start[1:] = a[1:] > reach[:-1]
    idx = np.nonzero(start)[0]
    ends = np.append(idx[1:], len(a)) - 1
    sids, los = sid[idx], first[idx]
    his = reach[ends] - sids * big
    plan.planned_bytes += int(((his - los) * itemsize[idx]).sum())
    for k, lo, hi in zip(sids.tolist(), los.tolist(), his.tolist()):
        file, skey, _ = index.stored[k]
        plan.reads.setdefault(file, []).append((skey, lo, hi))
