"""Local process groups for measurements (the planner's gloo link, the benchmark scripts): n spawned
processes on this host that form a gloo group on a free port, and the one answer a rank puts back."""

from __future__ import annotations

import queue
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on the loopback now (the OS picks it; a race with another binder is possible but
    harmless for a local measurement: its init then fails loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(target, nprocs: int, *args, timeout_s: float = 1800.0):
    """Run target(rank, port, *args, out) in nprocs spawned processes (spawn: no CUDA or thread state
    inherited) and return the first thing one of them puts on `out` (rank 0, by the targets' convention).
    Processes still alive a minute after the answer, or after the timeout, are killed: a rank stuck in a
    collective must not outlive the measurement."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    grace = 60.0  # after an answer, the ranks' own shutdown; after none, nothing is coming
    try:
        return out.get(timeout=timeout_s)
    except queue.Empty:  # a slow or overloaded machine, or a rank that died: one line, not a queue traceback
        grace = 0.0
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        raise TimeoutError(
            f"no answer from {nprocs} local processes within {timeout_s:g} s"
            + (f" (exit codes {dead})" if dead else " (a busy machine?)")
        ) from None
    finally:
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
