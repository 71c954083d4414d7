"""CPU threads per rank (train.threads) and the busy-machine warning.

torch starts one OpenMP thread per core. On a machine other jobs share, those threads wait on each other at
every op, and a one-process run measured 3-10x slower than with one thread; nothing said why. So the count
is chosen (and shown in the header) instead of inherited, and a load average above the core count is named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Threads:
    count: int
    source: str
    """Where the count comes from, for the header:
    `train.threads`, `OMP_NUM_THREADS` or `2 cores / 1 rank`."""

    @property
    def label(self) -> str:
        return f"threads {self.count} ({self.source})"


def usable_cores() -> int:
    """The cores this process may run on (a Slurm or taskset CPU set), not the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def pick_threads(setting: int | None, environ=os.environ) -> Threads:
    """train.threads when set; else OMP_NUM_THREADS when the environment sets it (the user's choice, or
    torchrun's 1 per worker); else the usable cores over the ranks on this node, at least 1."""
    from megaframe.parallel.launch import local_world_size

    if setting:
        return Threads(int(setting), "train.threads")
    omp = environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return Threads(int(omp), "OMP_NUM_THREADS")
    cores, local = usable_cores(), local_world_size(environ)
    return Threads(max(1, cores // local), f"{cores} cores / {local} rank{'s' if local != 1 else ''}")


def apply_threads(setting: int | None) -> Threads:
    """Set torch's intra-op threads for this rank (before the model is built); returns what was chosen."""
    import torch

    chosen = pick_threads(setting)
    torch.set_num_threads(chosen.count)
    return chosen


def load_warning(load: float, cores: int, threads: int) -> str | None:
    """One line when the 1-minute load average is above the machine's cores (other jobs compete for them),
    else None."""
    if load <= cores:
        return None
    hint = "; fewer threads often run faster there (train.threads=1)" if threads > 1 else ""
    return (
        f"the machine is busy (load average {load:.1f} on {cores} cores): steps will be slower than on an "
        f"idle machine{hint}"
    )


def busy_machine_warning(threads: int) -> str | None:
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return None
    return load_warning(load, os.cpu_count() or 1, threads)


def oversubscribed_warning(chosen: Threads, ranks_here: int, cpus: int | None = None) -> str | None:
    """One line when train.threads times this node's ranks is above the machine's CPUs (the config's rule
    refuses only far above: config/rules.py's max_threads), else None."""
    cpus = cpus or os.cpu_count() or 1
    if chosen.source != "train.threads" or chosen.count * ranks_here <= cpus:
        return None
    return (
        f"train.threads={chosen.count} x {ranks_here} rank(s) on this node is above its {cpus} CPUs: the "
        "threads wait on each other (fewer, at most CPUs / ranks, usually run faster)"
    )
