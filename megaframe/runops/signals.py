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

import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaframe.parallel.mesh import Mesh

SIGNALS = (
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGINT,
)  # Ctrl-C too: stop with a checkpoint, not a traceback


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

    def decide(self, mesh: Mesh, busy: bool = False, due: bool = False) -> tuple[bool, bool, bool]:
        """(any rank signalled, any rank `busy`, any rank `due`); collective over the mesh, call it at
        check steps only.

        `busy` and `due` ride along for free: the trainer passes whether this rank's async checkpoint
        writer is still running, so the commit needs no collective of its own, and whether its clock says
        a timed save is due (checkpoint.interval_minutes): ranks' clocks differ slightly, so the save
        follows the agreed flag, never a rank's own clock (a save is collective). The flags are a CPU tensor
        reduced over the mesh's world group, gloo on every device (with its configured timeout): the host
        waits only for the other hosts, never for the GPU's queue."""
        import torch  # not at import time: train.py installs the flag before torch is loaded
        import torch.distributed as dist

        from megaframe.parallel import comm
        from megaframe.parallel.mesh import Axis

        if mesh.group is None:
            return self.signum is not None, busy, due
        if self.group is None:
            self.group = Axis(
                "world", mesh.world, mesh.rank, tuple(range(mesh.world)), mesh.group, mesh.stats
            )
        # every flag in one tensor: one all-reduce per check step, not three
        flags = torch.tensor([float(self.signum is not None), float(busy), float(due)])
        # MAX: any rank signalled / still writing / due
        comm.all_reduce(flags, self.group, op=dist.ReduceOp.MAX)
        signalled, writing, timed = flags.tolist()  # a CPU tensor: no device sync
        return signalled > 0, writing > 0, timed > 0

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def report(self, step: int, hint: str = "") -> None:
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        print(
            f"megaframe: stopping at step {step} after {name}; checkpoint saved{hint}",
            file=sys.stderr,
            flush=True,
        )


def continue_command(
    run_name: str, argv: list[str] | None = None, env=None, signum: int | None = None
) -> str:
    """How to continue this run from the checkpoint just saved: the same command with the run's name (a
    default name is a new timestamp at every start; not needed where the command sets run.dir) and without a
    checkpoint.resume path (the default, auto, takes the newest checkpoint of the run). Inside
    pretrain.sbatch (MEGAFRAME_JOB_SCRIPT, the script as submitted) the pre-timeout SIGUSR1 stop is
    followed by the job's own requeue: that is said instead of a command to type."""
    env = os.environ if env is None else env
    argv = list(sys.argv[1:] if argv is None else argv)
    args = [a for a in argv if not a.lstrip("+~").startswith(("run.name=", "checkpoint.resume="))]
    if not any(a.lstrip("+").startswith("run.dir=") for a in argv):  # run.dir names the run's folder itself
        args.append(f"run.name={run_name}")
    if env.get("SLURM_JOB_ID"):
        script = env.get("MEGAFRAME_JOB_SCRIPT")
        if script and signum == signal.SIGUSR1:
            return f"; {os.path.basename(script)} requeues job {env['SLURM_JOB_ID']} to continue it"
        # a resubmission names the run: the script's own default name is the new job's id
        return (
            f"; continue with: MEGAFRAME_RUN_NAME={shlex.quote(run_name)} "
            f"sbatch {shlex.quote(script) if script else '<your job script>'} "
        ) + shlex.join(a for a in args if not a.startswith("run.name="))
    world = int(env.get("WORLD_SIZE", "1"))
    nodes = world // max(int(env.get("LOCAL_WORLD_SIZE", world)), 1)
    launch = (
        "python train.py"
        if world == 1
        else (
            "torchrun "
            f"{f'--nnodes={nodes} ... ' if nodes > 1 else ''}"
            f"--nproc-per-node={env.get('LOCAL_WORLD_SIZE', world)} train.py"
        )
    )
    make = (
        f" (or: make train RUN={shlex.quote(run_name)})"
        if world == 1 and not argv and env.get("MEGAFRAME_RUN_NAME")
        else ""
    )
    return f"; continue with: {launch} {shlex.join(args)}{make}"
