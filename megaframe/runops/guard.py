"""What watches a training run besides its steps, in one place: the hang watchdog, the stop flag
(signals and timed saves, agreed at check steps), the straggler probe and injected faults. The loop
asks it three things: `beat` at a step's start, `decide` after the step, `close` at the end."""

from __future__ import annotations

from megaframe.config.schema import TrainConfig
from megaframe.errors import ConfigError
from megaframe.parallel.mesh import Mesh
from megaframe.runops.faults import Injector
from megaframe.runops.signals import StopFlag, continue_command
from megaframe.runops.straggler import StragglerProbe
from megaframe.runops.watchdog import Watchdog


class RunGuard:
    """Built before start-up (a fault may be injected into the resume's load); the watchdog starts with
    `watch`, after start-up: resume and shard checks may take longer than a step's hang limit."""

    def __init__(self, t: TrainConfig, mesh: Mesh, stop: StopFlag, run_dir: str, run_name: str):
        self.t, self.mesh, self.stop, self.run_dir, self.run_name = t, mesh, stop, run_dir, run_name
        self.faults = injector(mesh.rank)
        self.probe = StragglerProbe(self.faults)
        self.watchdog: Watchdog | None = None

    def watch(self) -> Watchdog:
        self.watchdog = Watchdog(self.t.hang_timeout_s, self.mesh.rank, self.run_dir, self.mesh.stats).start()
        return self.watchdog

    def beat(self, step: int) -> None:
        """A step begins: the watchdog hears it, and the comm counters hold only this step's bytes."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
        self.mesh.stats.pop()

    def decide(self, step: int, start: int, ckpt) -> tuple[bool, bool]:
        """(stop now, a timed save is due), the same on every rank. At check steps only (one host
        all-reduce); `ckpt` (training's Checkpointer) commits its background save when every rank's
        writer is done: the all-reduced flag, so all ranks commit or none does."""
        if not checks_at(step, start, self.t):
            return False, False
        stopping, writing, timed = self.stop.decide(self.mesh, busy=ckpt.writing(), due=ckpt.overdue())
        ckpt.poll(all_written=not writing)
        return stopping, timed

    def report_stop(self, step: int) -> None:
        if self.mesh.is_logger:  # one line for the run, not one per rank
            self.stop.report(step, continue_command(self.run_name, signum=self.stop.signum))

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.stop.restore()


def checks_at(step: int, start: int, t: TrainConfig) -> bool:
    """Steps at which the ranks agree on stop signals and async-save completion (one host-side
    all-reduce over every rank): the first step, every train.signal_check_interval, log and last steps."""
    return (
        step == start + 1
        or step % t.signal_check_interval == 0
        or step % t.log_interval == 0
        or step == t.max_steps
    )


def injector(rank: int) -> Injector | None:
    """MEGAFRAME_INJECT's faults for this rank (read once, at start); a malformed value is bad input."""
    try:
        return Injector.from_env(rank)
    except ValueError as e:
        raise ConfigError(str(e)) from e
