"""Activations in flight: a rank's compute order (pipeline/schedule.py, the order the trainer runs)
walked forward by forward, each F adding its chunk's saved bytes and each B freeing them (a split backward's
W freeing what it reads). What a schedule holds is what its order holds: 1F1B's warm-up keeps pp - rank
micro-batches, interleaved ones more (their chunks' warm-up), zero-bubble ones the pending Ws too."""

from __future__ import annotations

import functools

from megaframe.pipeline.schedule import F, W, compute_order, splits_backward


def peak_activations(order, chunk_bytes: list[int], w_bytes: list[int] | None = None) -> tuple[int, int]:
    """(peak bytes, chunks held at that peak) walking a rank's compute order: F adds, B frees; under a
    split backward (W in the order) B frees all but w_bytes (what W reads), which W frees."""
    held = count = peak = peak_count = 0
    keep = w_bytes or [0] * len(chunk_bytes)
    for a in order:
        if a.kind == W:
            held -= keep[a.chunk]
        else:
            sign = 1 if a.kind == F else -1
            held += sign * chunk_bytes[a.chunk] + (0 if a.kind == F else keep[a.chunk])
            count += sign
        if held > peak:
            peak, peak_count = held, count
    return peak, peak_count


@functools.lru_cache(maxsize=None)
def peak_inflight(kind: str, pp: int, vpp: int, m: int, rank: int, chunk_bytes: tuple) -> int:
    """Peak activation bytes of the rank's order; a split backward's pending W keeps W_FRACTION of a chunk
    (the weighted ops' inputs and output grads: planning.memory.activations.w_fraction, ~0.49 for llama3_8b's
    blocks)."""
    from megaframe.pipeline.simulate import W_FRACTION

    keep = [int(W_FRACTION * b) for b in chunk_bytes] if splits_backward(kind) else None
    return peak_activations(rank_order(kind, pp, vpp, m, rank), list(chunk_bytes), keep)[0]


@functools.lru_cache(maxsize=None)
def rank_order(kind: str, pp: int, vpp: int, m: int, rank: int) -> tuple:
    """A rank's compute order, built once per schedule (every micro-batch size and recompute shares it)."""
    return tuple(compute_order(kind, pp, vpp, m, rank))
