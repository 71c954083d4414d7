"""Stop signals: SIGTERM, SIGUSR1 or SIGINT on any rank stops every rank at the same step boundary.

The handler only sets a flag (it runs between bytecodes, so it must not touch collectives). At check
steps (every train.signal_check_interval steps, and the first, log and last steps: the same steps on
every rank) the ranks take the max of their flags in one small host-side all-reduce; once it is set,
all of them save a checkpoint and leave the loop together. Between check steps no collective over the
whole job runs: at hundreds of ranks that gloo round costs milliseconds and is a host barrier.
Slurm's `--signal`, torchrun (which forwards SIGTERM, and SIGUSR1 with --signals-to-handle) and
`kill` all reach it.
"""
from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaframe.parallel.mesh import Mesh

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # Ctrl-C too: stop with a checkpoint, not a traceback


class StopFlag:
    """Installed by train.py before its slow imports: a signal during start-up is kept, not fatal."""

    def __init__(self):
        self.signum: int | None = None
        self.group = None  # the world axis the flag is reduced over (set at the first agreed())
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self, mesh: Mesh) -> bool:
        """Whether any rank has been signalled; collective over the mesh."""
        return self.decide(mesh)[0]

    def decide(self, mesh: Mesh, busy: bool = False) -> tuple[bool, bool]:
        """(any rank signalled, any rank `busy`); collective over the mesh, call it at check steps only.

        `busy` rides along for free: the trainer passes whether this rank's async checkpoint writer
        is still running, so the commit needs no collective of its own. The flags are a CPU tensor
        reduced over the mesh's world group, gloo on every device (with its configured timeout): the host
        waits only for the other hosts, never for the GPU's queue."""
        import torch  # not at import time: train.py installs the flag before torch is loaded
        import torch.distributed as dist

        from megaframe.parallel import comm
        from megaframe.parallel.mesh import Axis

        if mesh.group is None:
            return self.signum is not None, busy
        if self.group is None:
            self.group = Axis("world", mesh.world, mesh.rank, tuple(range(mesh.world)), mesh.group, mesh.stats)
        # both flags in one tensor: one all-reduce per check step, not two
        flags = torch.tensor([0.0 if self.signum is None else 1.0, 1.0 if busy else 0.0])
        comm.all_reduce(flags, self.group, op=dist.ReduceOp.MAX)  # MAX: any rank signalled / any still writing
        signalled, writing = flags.tolist()  # a CPU tensor: no device sync
        return signalled > 0, writing > 0

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def report(self, step: int) -> None:
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        print(f"megaframe: stopping at step {step} after {name}; checkpoint saved", file=sys.stderr, flush=True)
