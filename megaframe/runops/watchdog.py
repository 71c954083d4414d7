"""Hang watchdog: a daemon thread per rank that ends a run making no progress, leaving evidence.

The trainer feeds it a heartbeat at every step boundary (and around checkpoints). Work between two steps
(validation, sampling, downstream scoring) runs in a named `phase` and beats per batch it scores: a long
evaluation is progress, a collective hung inside it still trips after `train.hang_timeout_s` without a
beat; work with no batches to beat by (loading lm-eval's tasks) gets an allowance of its own, as a save
gets checkpoint.save_timeout_s. After `train.hang_timeout_s` seconds without a beat it writes this
rank's report to stderr and to `${run.dir}/hang/rank{R}.txt`, then ends the process with exit code 124
via os._exit: a rank blocked inside a collective never returns to Python, so raising or sys.exit could
not end it.
The report holds the step, the seconds since the last heartbeat, the last collectives the rank
entered (op, group and its global ranks, shape, dtype, bytes, how long ago, whether a blocking call
returned or an async one was waited for, and on CUDA whether the GPU completed it or it is only
enqueued; from the CommStats ring buffer that megaframe.parallel.comm fills) and the Python stack
of every thread. The newest collective that has not completed is usually where the rank waits; the
rank that never entered it, or is still in compute, is the one to look at.

Every rank trips on its own (they all stop making progress), so no collective is needed and a dead
peer cannot block the report. After its report a rank waits a grace period (timeout/10, between 2
and 30 s) before exiting: its peers stopped at the same step and trip within a poll interval, and
they must write their reports before this rank's closed connections turn their waits into errors.
0 disables the watchdog.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from megaframe.parallel.flight import CommStats

HANG_EXIT_CODE = 124
SAVE_TIMEOUT_EXIT_CODE = 1
"""A save past checkpoint.save_timeout_s is a failed save (nothing committed, the previous checkpoint
intact: a commit is atomic), not a hang: exit 1 with one line naming both, like any failed save."""
SHOW_COLLECTIVES = 32


def collective_state(e: dict) -> str:
    """A ring-buffer entry's state. On NCCL a returned host call (or a waited Work) only enqueued the
    collective on a stream: its CUDA event (CommStats.returned) says whether the GPU got past it."""
    if not e["done"]:
        return "async, NOT WAITED FOR YET" if e["async"] else "NOT RETURNED"
    event = e.get("event")
    if event is None:
        return "returned"  # a host (gloo/CPU) collective: returned means done
    return "completed on the GPU" if event.query() else "ENQUEUED, NOT COMPLETED on the GPU"


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        rank: int,
        run_dir: str,
        stats: CommStats,
        exit_fn=os._exit,
        grace_s: float | None = None,
    ):
        self.timeout_s, self.rank, self.run_dir, self.stats = timeout_s, rank, run_dir, stats
        self.exit_fn = exit_fn  # tests pass a recorder instead of ending the process
        self.grace_s = min(30.0, max(2.0, timeout_s / 10)) if grace_s is None else grace_s
        self.step, self.last = 0, time.monotonic()
        self.override: float | None = None  # the limit while suspended() (a save or load)
        self.overrun = (
            None  # while suspended(): the one line an overrun ends with (exit 1), else a hang (124)
        )
        self.doing: str | None = None  # the phase between two steps, named in the report
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        if self.timeout_s > 0:
            self.last = time.monotonic()
            # daemon: a run that ends normally never waits for the watcher
            self._thread = threading.Thread(
                target=self._watch, name=f"megaframe-watchdog-rank{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Progress: called by the training loop; cheap (two assignments)."""
        if step is not None:
            self.step = step
        # plain assignments read by the watch thread: atomic under the GIL, no lock on the step path
        self.last = time.monotonic()

    @contextmanager
    def suspended(self, limit_s: float, overrun=None):
        """A checkpoint save or load: slow is not hung, so it is judged by its own limit
        (checkpoint.save_timeout_s) instead of train.hang_timeout_s. `overrun()`, when given, returns the
        error line of exceeding it: the process then ends with exit 1 (a failed save), not 124."""
        self.beat()
        before = (self.override, self.overrun)
        self.override, self.overrun = limit_s, overrun
        try:
            yield
        finally:
            self.override, self.overrun = before
            self.beat()

    @contextmanager
    def phase(self, name: str, limit_s: float | None = None):
        """Work between two steps (`name`: validation, sampling, downstream scoring). Its own progress
        counts: it calls `beat()` per batch, judged by train.hang_timeout_s as steps are. `limit_s`, when
        given, is the limit instead, for work with no batches to beat by (`allow` changes it inside); a
        phase past its limit is a hang (exit 124). Phases nest: the outer one's state comes back."""
        before = (self.doing, self.override, self.overrun)
        self.doing, self.override, self.overrun = name, limit_s, None
        self.beat()
        try:
            yield self
        finally:
            self.doing, self.override, self.overrun = before
            self.beat()

    def allow(self, limit_s: float | None) -> None:
        """Inside a phase: judge by `limit_s` from now on (None: train.hang_timeout_s), counting from now."""
        self.override = limit_s
        self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        # a tenth of the limit (at most 1 s): a trip comes within 10% of the timeout, and ranks tripping at
        # the same step report close together
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            idle, limit = time.monotonic() - self.last, self.override  # monotonic: a clock change is no hang
            if limit is None:
                limit = self.timeout_s
            if limit > 0 and idle > limit:
                self.trip(idle)
                return

    def trip(self, idle: float) -> None:
        text = self.report(idle)
        print(text, file=sys.stderr, flush=True)
        try:
            path = Path(self.run_dir) / "hang" / f"rank{self.rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as e:  # the report on stderr is what matters; a full disk must not hide it
            print(
                f"megaframe: rank {self.rank}: could not write the hang report: {e}",
                file=sys.stderr,
                flush=True,
            )
        overrun = self.overrun
        if overrun is not None:  # the last line a reader sees: the failed save and what is intact
            print(f"megaframe: error: {overrun()}", file=sys.stderr, flush=True)
        # let the peers, stuck at the same step, write their
        # reports before this rank's exit breaks their connections
        time.sleep(self.grace_s)
        self.exit_fn(HANG_EXIT_CODE if overrun is None else SAVE_TIMEOUT_EXIT_CODE)

    def report(self, idle: float) -> str:
        now = time.time()
        limit = "train.hang_timeout_s=" + f"{self.timeout_s:g}"
        if self.override is not None:
            limit = f"its allowance of {self.override:g}s"
        where = f" in {self.doing}" if self.doing else ""
        lines = [
            f"megaframe: rank {self.rank}: HANG: no progress for {idle:.1f}s ({limit}){where} after step "
            f"{self.step}; exiting with code {HANG_EXIT_CODE}",
            f"last {SHOW_COLLECTIVES} collectives entered by rank {self.rank} (oldest first):",
        ]
        for e in self.stats.last(SHOW_COLLECTIVES):
            state = collective_state(e)
            lines.append(
                f"  {now - e['t']:8.2f}s ago  {e['op']:<24} group {e['group']} ranks {list(e['ranks'])}  "
                f"shape {list(e['shape'])} {e['dtype']} {e['bytes']} B  {state}"
            )
        lines.append(f"python stacks of rank {self.rank}:")
        names = {t.ident: t.name for t in threading.enumerate()}
        main = threading.main_thread().ident
        frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)  # the main thread first
        for ident, frame in frames:
            lines.append(f"  thread {names.get(ident, ident)}:")
            lines += [
                "    " + ln for chunk in traceback.format_stack(frame) for ln in chunk.rstrip().splitlines()
            ]
        return "\n".join(lines) + "\n"
