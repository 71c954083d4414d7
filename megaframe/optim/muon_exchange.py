"""Muon under ZeRO: each hidden matrix's direction goes from the ranks owning its ranges to the one rank of
the shard axis that orthogonalises it (its owner, optim/muon.py `_owners`), and each rank's ranges of the
result come back: two all-to-alls per shard axis and step, for all of the axis's matrices at once.

A rank sends its ranges of the matrices others own and, as an owner, the others' ranges of its own
matrices: about twice its share of the matrices' elements (its ranges and the owner's work are both
balanced), where summing every whole matrix over the axis and broadcasting it from its owner sent about
three times all of them from each rank (an all-reduce 2(n-1)/n, the owner's broadcast 1).

`ranges[p][r]` is (first element, length) of rank r's range of p's flat local tensor (length 0 where r owns
none); a parameter lies in one bucket, so a rank owns at most one range of it. Every rank of the axis
walks the same matrices in the same order, so the pieces' order in each message is known to both ends.
"""

from __future__ import annotations

import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


def _cat(parts: list[torch.Tensor], device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=device)


def to_owners(axis: Axis, mats: list, ranges: dict, owner: dict, pieces: dict, device) -> dict:
    """`pieces[p]`: this rank's range of p's direction (fp32, 1-D; absent where it owns none). Returns
    {p: p's whole flat direction} for the matrices this rank owns, in `mats` order."""
    me, n = axis.rank, axis.size
    send = [[pieces[p] for p in mats if owner[p] == o and ranges[p][me][1]] for o in range(n)]
    in_splits = [sum(t.numel() for t in s) for s in send]
    mine = [p for p in mats if owner[p] == me]
    out_splits = [sum(ranges[p][r][1] for p in mine) for r in range(n)]
    recv = comm.all_to_all_rows(_cat([t for s in send for t in s], device), axis, out_splits, in_splits)
    whole = {p: torch.empty(p.numel(), dtype=torch.float32, device=device) for p in mine}
    pos = 0
    for r in range(n):  # rank r's pieces of this rank's matrices, in mats order
        for p in mine:
            lo, k = ranges[p][r]
            whole[p][lo : lo + k] = recv[pos : pos + k]
            pos += k
    return whole


def from_owners(axis: Axis, mats: list, ranges: dict, owner: dict, results: dict, device) -> dict:
    """`results[p]`: p's whole flat update, for the matrices this rank owns. Returns {p: this rank's range of
    p's update} for every matrix of `mats` it holds a range of."""
    me, n = axis.rank, axis.size
    mine = [p for p in mats if owner[p] == me]
    parts = [results[p][lo : lo + k] for r in range(n) for p in mine for lo, k in [ranges[p][r]]]
    in_splits = [sum(ranges[p][r][1] for p in mine) for r in range(n)]
    out_splits = [sum(ranges[p][me][1] for p in mats if owner[p] == o) for o in range(n)]
    recv = comm.all_to_all_rows(_cat(parts, device), axis, out_splits, in_splits)
    out, pos = {}, 0
    for o in range(n):  # owner o's results for this rank's ranges, in mats order
        for p in mats:
            if owner[p] == o and ranges[p][me][1]:
                k = ranges[p][me][1]
                out[p] = recv[pos : pos + k]
                pos += k
    return out


def rank_ranges(buf, p) -> list[tuple[int, int]]:
    """(first element, length) of each axis rank's range of p's flat local tensor in FlatBuffer `buf`."""
    b, off = buf.bucket_of[p], buf.offset[p]
    per = b.shard_numel(buf.dp_size)
    out = []
    for r in range(buf.dp_size):
        lo = max(b.start + r * per, off)
        hi = min(b.start + (r + 1) * per, off + p.numel())
        out.append((lo - off, hi - lo) if lo < hi else (0, 0))
    return out
