"""What watches a training run besides its steps, in one place: the hang watchdog, the stop flag
(signals and timed saves, agreed at check steps), the straggler probe and injected faults. The loop
asks it: `beat` at a step's start, `between` around the work between two steps (saves, validation,
sampling, downstream scoring; that work calls `progress` per batch), `decide` after the step and that
work, `close` at the end."""

from __future__ import annotations

import contextlib

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

    @contextlib.contextmanager
    def between(self, name: str):
        """Work between two steps, `name`d in a hang report: the watchdog judges it by its own beats
        (`progress`, per batch), so a long evaluation is not a hang and a collective hung in it still is;
        its traffic is not the step's (kept out of comm_bytes)."""
        counted = self.mesh.stats.pop()
        try:
            with self.watchdog.phase(name) if self.watchdog is not None else contextlib.nullcontext():
                yield
        finally:
            self.mesh.stats.pop()
            for group, nbytes in counted.items():
                self.mesh.stats.add(group, nbytes)

    def progress(self) -> None:
        """A batch of the work between two steps is done: the watchdog hears it."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def signalled(self) -> bool:
        """Whether this rank has a stop signal (host only; the ranks agree on it at check steps)."""
        return self.stop.signum is not None

    def decide(self, step: int, start: int, ckpt, evaluated: bool = False) -> tuple[bool, bool]:
        """(stop now, a timed save is due), the same on every rank. At check steps only (one host
        all-reduce), and after a step's evaluation (`evaluated`, the same on every rank: a signal that came
        during a long evaluation stops the run at once); `ckpt` (training's Checkpointer) commits its
        background save when every rank's writer is done: the all-reduced flag, so all ranks commit or
        none does."""
        if not (evaluated or checks_at(step, start, self.t)):
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
