"""Fault injection for tests and drills: make one rank slow or hang, on purpose.

Set once in the environment of every rank (read at start-up, then passed to the step as state):

    MEGAFRAME_INJECT="sleep:rank=1:seconds=0.3"        rank 1 computes 0.3 s longer every step
    MEGAFRAME_INJECT="sleep:rank=1:seconds=0.3:step=5" ... at step 5 only
    MEGAFRAME_INJECT="hang:rank=1:step=3"              rank 1 blocks forever at the start of step 3
    MEGAFRAME_INJECT="kill:rank=0:step=6"              rank 0 is SIGKILLed at the start of step 6 (steps
                                                       after the last checkpoint are lost; goodput drills)
    MEGAFRAME_INJECT="sleep:rank=0:seconds=1;hang:rank=2:step=9"   several, separated by ';'
    MEGAFRAME_INJECT="slow_save:rank=0:seconds=8"      rank 0's checkpoint saves take 8 s longer (step=S: that
                                                       save)
    MEGAFRAME_INJECT="savefail:rank=1:step=4"          rank 1's checkpoint write at step 4 fails as on a full
                                                       disk (safetensors' SafetensorError, ENOSPC)
    MEGAFRAME_INJECT="savekill:rank=1:step=4"          rank 1 is SIGKILLed in the middle of that write
    MEGAFRAME_INJECT="loadoom:rank=1:step=6"           rank 1 runs out of memory (torch.OutOfMemoryError)
                                                       while loading the checkpoint of step 6 at resume (no
                                                       step: any)

`rank` is the global rank (omitted: every rank); `step` the optimizer step (omitted: every step for
sleep, step 1 for hang and kill). A kill, like a failed save, strikes a torchrun group's first attempt only.
The delay happens at the start of the step's compute window, so the straggler
figures count it as compute; a hang never returns, so only the watchdog (train.hang_timeout_s) ends it.
An unparsable value is a bad input (exit 2).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

ENV = "MEGAFRAME_INJECT"


@dataclass(frozen=True)
class Fault:
    kind: str
    """sleep | hang | kill | slow_save | savefail | savekill | loadoom."""
    rank: int | None
    step: int | None
    seconds: float = 0.0


def parse(spec: str) -> list[Fault]:
    """The faults of a MEGAFRAME_INJECT value; ValueError naming the variable when malformed."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, *fields = part.split(":")
        try:
            kv = dict(f.split("=", 1) for f in fields)
            rank = int(kv.pop("rank")) if "rank" in kv else None
            step = int(kv.pop("step")) if "step" in kv else (1 if kind in ("hang", "kill") else None)
            seconds = float(kv.pop("seconds", 0.0))
        except ValueError as e:
            raise ValueError(f"{ENV}={spec!r}: cannot parse {part!r} ({e})") from e
        if (
            kind not in ("sleep", "hang", "kill", "slow_save", "savefail", "savekill", "loadoom")
            or kv
            or (kind in ("sleep", "slow_save") and seconds <= 0)
        ):
            raise ValueError(
                f"{ENV}={spec!r}: {part!r} must be sleep|slow_save:[rank=R:][step=S:]seconds=X "
                f"or hang|kill|savefail|savekill|loadoom:[rank=R:][step=S]"
            )
        faults.append(Fault(kind, rank, step, seconds))
    return faults


class Injector:
    """This rank's faults; `apply(step)` runs them and returns the seconds it slept."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank in (None, rank)]
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int) -> "Injector | None":
        spec = os.environ.get(ENV, "")
        return cls(parse(spec), rank) if spec else None

    def save_fault(self, step: int) -> str | None:
        """ "error" | "kill" when this rank's checkpoint write at `step` is to fail, else None. Only in a
        group's first attempt: a worker group torchrun restarted must not be killed again."""
        # a restart would hit the same fault at the same step forever: the drill is one failure
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        for f in self.faults:
            if f.kind in ("savefail", "savekill") and f.step in (None, step):
                return "error" if f.kind == "savefail" else "kill"
        return None

    def load_fault(self, step: int) -> None:
        """Raise torch.OutOfMemoryError when a loadoom fault names this rank and the checkpoint's `step`: what
        a resume that runs out of memory sees (it must stop the run, not skip the checkpoint)."""
        import torch

        for f in self.faults:
            if f.kind == "loadoom" and f.step in (None, step):
                raise torch.OutOfMemoryError(f"injected out of memory on rank {self.rank} ({ENV})")

    def apply(self, step: int) -> float:
        slept = 0.0
        for f in self.faults:
            if f.kind not in ("sleep", "hang", "kill"):
                continue
            if f.step is not None and f.step != step:
                continue
            if f.kind == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                print(f"megaframe: rank {self.rank}: injected kill at step {step} ({ENV})", file=sys.stderr)
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "kill":
                continue
            if f.kind == "hang":
                print(
                    f"megaframe: rank {self.rank}: injected hang at step {step} ({ENV})",
                    file=sys.stderr,
                    flush=True,
                )
                threading.Event().wait()  # forever; the watchdog ends the process
            # inside the compute window (probe.begin): the straggler figures must see it as compute
            time.sleep(f.seconds)
            slept += f.seconds
        return slept

    def save_delay(self, step: int) -> float:
        """Sleep as a slow_save fault says, inside the save
        of `step` (watchdog drills); returns the seconds."""
        slept = sum(f.seconds for f in self.faults if f.kind == "slow_save" and f.step in (None, step))
        time.sleep(slept)
        return slept
