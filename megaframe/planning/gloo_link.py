"""The "cpu" device's link, measured as the ranks use it: gloo collectives between two local processes.

A TCP ping between two threads (a few microseconds, GB/s) says little about gloo: a collective of a few
hundred KB costs ~1 ms on this kind of machine (rendezvous, its I/O threads, copies), 100x the ping. So
the planner's cpu figures are a curve of measured times of one ring hop against the bytes it carries:
an all-gather of s bytes per rank between 2 ranks is one hop of s bytes, as is a reduce-scatter of 2s
(each rank sends the half it does not keep). A hop's time is the mean of the two, each the
interquartile mean of 40 repeats (12 above 256 KiB) that follow a burst of matmuls on both ranks: a
collective inside a step costs a computing rank more than one in a tight loop (the peer's arrival
skew, gloo's threads waking), 2-5x at these sizes. (A median of 15 moved 2x between runs at 16-256 KiB;
this moves ~15 %.)
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from megaframe.parallel.local import spawn_local

SIZES = (4, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
"""Bytes per hop measured: from a scalar to a ZeRO bucket's share."""
BURST = 8
"""256x256 matmuls between two timed collectives (~1-2 ms of compute on a core)."""


def _in_step(fn, reps: int, work: torch.Tensor) -> float:
    """Interquartile-mean seconds of fn, each call right after a burst of matmuls (a rank reaching a
    collective mid-step: its peer arrives a little earlier or later, gloo's threads wake from sleep)."""
    fn()  # warm-up: gloo's first call on a size sets up its buffers
    times = []
    for _ in range(reps):
        for _ in range(BURST):
            work @ work
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    mid = times[len(times) // 4 : len(times) - len(times) // 4]  # the interquartile mean: stable across runs
    return sum(mid) / len(mid)


def _worker(rank: int, port: int, out) -> None:
    from megaframe.parallel import comm
    from megaframe.parallel.mesh import Axis, CommStats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        axis = Axis("link", 2, rank, (0, 1), dist.group.WORLD, CommStats())
        curve, work = [], torch.randn(256, 256)
        for s in SIZES:
            x = torch.ones(max(1, s // 4))
            both = torch.empty(2 * x.numel())
            reps = 40 if s <= 256 << 10 else 12
            ag = _in_step(lambda b=both, y=x: comm.all_gather_flat(b, y, axis), reps, work)
            rs = _in_step(lambda b=both, y=x: comm.reduce_scatter_flat(y, b, axis), reps, work)
            # a larger hop never costs less than a smaller one: averages of noisy repeats may say so
            curve.append((s, max((ag + rs) / 2, curve[-1][1] if curve else 0.0)))
        if rank == 0:
            out.put(curve)
    finally:
        dist.destroy_process_group()


def measure_hops(timeout_s: float = 120.0) -> tuple[tuple[int, float], ...]:
    """((bytes, seconds of one hop), ...) for SIZES, from two spawned gloo processes (~5 s)."""
    return tuple(spawn_local(_worker, 2, timeout_s=timeout_s))


def hop_seconds(curve: tuple[tuple[int, float], ...], nbytes: float) -> float:
    """One hop of nbytes on a measured curve: log-log interpolation between points; below the first
    point its time (latency-bound), beyond the last its time plus the extra bytes at the last segment's
    bandwidth."""
    if nbytes <= curve[0][0]:
        return curve[0][1]
    for (s0, t0), (s1, t1) in zip(curve, curve[1:]):
        if nbytes <= s1:
            w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return curve[-1][1] + (nbytes - curve[-1][0]) * tail_seconds_per_byte(curve)


def tail_seconds_per_byte(curve: tuple[tuple[int, float], ...]) -> float:
    """The last segment's seconds a byte; where noise left its two hops equal (the curve never falls: a
    larger hop's faster average is raised to the smaller one's), the largest hop's own average."""
    (s0, t0), (s1, t1) = curve[-2], curve[-1]
    return (t1 - t0) / (s1 - s0) if t1 > t0 else t1 / s1
