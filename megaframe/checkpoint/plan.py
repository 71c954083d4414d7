"""The read planner: a pure function of (checkpoint metadata, what this rank needs) giving the byte
ranges of each file to read and where each piece goes. It reads no tensor data, so every rank of a
1000-rank loading layout can be planned in one process (tests/unit/test_checkpoint_plan.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from megaframe.checkpoint.boxes import Box, flat_span, intersect, shift, volume
from megaframe.checkpoint.metadata import CheckpointError


class Index:
    """Per logical tensor, its stored pieces as arrays, for fast intersection with the boxes a rank needs."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self._by_key: dict[str, tuple] = {}

    def pieces(self, key: str):
        if key not in self._by_key:
            info = self.tensors.get(key)
            if info is None:
                raise CheckpointError(f"the checkpoint has no tensor {key}")
            rows = [(s, tuple(map(tuple, local)), tuple(map(tuple, glob)))
                    for s in info["shards"] for local, glob in s["pieces"]]
            nd = len(info["global_shape"])
            lo = np.array([[a for a, _ in g] for _, _, g in rows], dtype=np.int64).reshape(-1, nd)
            hi = np.array([[b for _, b in g] for _, _, g in rows], dtype=np.int64).reshape(-1, nd)
            size = torch.empty((), dtype=getattr(torch, info["dtype"])).element_size()
            self._by_key[key] = (lo, hi, rows, size)
        return self._by_key[key]


@dataclass
class Copy:
    file: str
    stored_key: str
    stored_shape: tuple
    src: Box
    key: str
    dst: Box


@dataclass
class Plan:
    reads: dict = field(default_factory=dict)
    """file -> [(stored key, first element, last element)], ranges merged per stored tensor."""
    copies: list = field(default_factory=list)
    needed_bytes: int = 0
    planned_bytes: int = 0


def plan_reads(index: Index, need: dict[str, list[tuple[Box, Box]]]) -> Plan:
    """The reads and copies that give this rank every (local box, global box) it needs exactly once.
    CheckpointError when the checkpoint does not cover a needed box exactly once."""
    plan, spans = Plan(), {}
    for key, pairs in need.items():
        lo, hi, rows, size = index.pieces(key)
        for local, glob in pairs:
            g_lo = np.array([a for a, _ in glob], dtype=np.int64)
            g_hi = np.array([b for _, b in glob], dtype=np.int64)
            hits = np.nonzero(np.all((lo < g_hi) & (hi > g_lo), axis=1))[0]
            got = 0
            for h in hits.tolist():
                s, p_local, p_glob = rows[h]
                part = intersect(glob, p_glob)
                src = shift(part, p_glob, p_local)
                plan.copies.append(Copy(s["file"], s["key"], tuple(s["shape"]), src, key, shift(part, glob, local)))
                first, last = flat_span(tuple(s["shape"]), src)
                spans.setdefault((s["file"], s["key"], size), []).append((first, last))
                got += volume(part)
            want = volume(glob)
            if got != want:
                raise CheckpointError(f"tensor {key}: the checkpoint holds {got} of the {want} elements "
                                      f"of {list(glob)} this rank needs ({'a gap' if got < want else 'overlapping shards'})")
            plan.needed_bytes += want * size
    for (file, skey, size), ranges in spans.items():
        merged = _merge(ranges)
        plan.reads.setdefault(file, []).extend((skey, a, b) for a, b in merged)
        plan.planned_bytes += sum(b - a for a, b in merged) * size
    return plan


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def stored_numel(shape) -> int:
    return math.prod(shape)
