"""train.profile_steps and train.memory_snapshot: a torch.profiler trace of chosen steps, per rank, and
torch's CUDA memory snapshot of chosen steps and of an out-of-memory error.

Traces go to ${run.dir}/profile/rank<R>_steps<A>-<B>.json.gz (Chrome trace format: Perfetto and
chrome://tracing open it; `python -m megaframe.plot --trace` draws it). Each run of consecutive steps is
one trace: the profiler starts at the first and stops after the last, once every collective of the step
was waited for (a gloo record closed after the profile ended would write into freed memory, see
phase_meter.AllocatorProfile). While it records, the mesh's observer names ranges (parallel/observe.py):
`step N`, every pipeline action, every collective (kind, axis, bytes) and `optimizer_step`.

Off (both lists empty) the loop holds no profiler object and the observer names nothing: no cost.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def runs_of(steps: list[int]) -> dict[int, int]:
    """{first step: last step} of each run of consecutive steps in `steps`."""
    out, first = {}, None
    ordered = sorted(set(steps))
    for i, s in enumerate(ordered):
        if first is None:
            first = s
        if i + 1 == len(ordered) or ordered[i + 1] != s + 1:
            out[first] = s
            first = None
    return out


class StepProfiler:
    """`with prof.step(n):` around the loop's step `n`; records the steps of train.profile_steps."""

    def __init__(
        self, steps: list[int], run_dir: str, rank: int, observer, device: torch.device, all_threads=False
    ):
        self.runs, self.rank, self.observer, self.device = runs_of(steps), rank, observer, device
        # an overlapped pipeline kind runs each pair's forward on a worker thread (pipeline/overlap.py):
        # the profiler records the thread that started it only, unless told to record them all
        self.all_threads = all_threads
        self.folder = Path(run_dir) / "profile"
        self.prof, self.first, self.last = None, 0, 0
        self.written: list[Path] = []

    def begin(self, step: int) -> None:
        if self.prof is None and step in self.runs:
            from torch.profiler import ProfilerActivity, profile

            os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # no kineto banner between the step lines
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            from torch._C._profiler import _ExperimentalConfig

            every = (
                {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
                if self.all_threads
                else {}
            )
            self.prof = profile(activities=acts, record_shapes=False, **every)
            self.prof.__enter__()
            self.first, self.last = step, self.runs[step]
            self.observer.ranges = True
        if self.prof is not None:
            self._range = torch.autograd.profiler.record_function(f"step {step}")
            self._range.__enter__()

    def end(self, step: int) -> Path | None:
        """Close step `step`'s range; after a run's last step, stop and write its trace (its path)."""
        if self.prof is None:
            return None
        self._range.__exit__(None, None, None)
        if step < self.last:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.observer.ranges = False
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}_steps{self.first}-{self.last}.json.gz"
        prof.export_chrome_trace(str(path))  # a .gz name: torch writes it gzipped
        self.written.append(path)
        return path

    def close(self) -> None:
        """A run that ends inside a profiled run of steps (a stop, an error) stops the profiler unsaved."""
        if self.prof is not None:
            self.observer.ranges = False
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)


class CudaMemory:
    """The CUDA calls MemorySnapshots makes (a seam: the unit tests inject a recorder in their place)."""

    def record(self, on: bool) -> None:
        torch.cuda.memory._record_memory_history("all" if on else None, max_entries=100_000)

    def dump(self, path: str) -> None:
        torch.cuda.memory._dump_snapshot(path)


class MemorySnapshots:
    """train.memory_snapshot: history recorded from the first chosen step, a snapshot after each chosen
    step; and on any CUDA run one at an out-of-memory error (`oom`), then the error goes on. On a CPU
    device: nothing."""

    def __init__(self, steps: list[int], run_dir: str, rank: int, device: torch.device, cuda=None):
        self.steps = sorted(set(steps))
        self.cuda_device = device.type == "cuda"
        self.on = bool(self.steps) and self.cuda_device
        self.recording = False
        self.folder, self.rank, self.cuda = Path(run_dir) / "profile", rank, cuda or CudaMemory()
        if self.steps and not self.on and rank == 0:
            print("megaframe: note: train.memory_snapshot is CUDA only; ignored on cpu", file=sys.stderr)

    def begin(self, step: int) -> None:
        # from the first chosen step to the last (a resume past the first starts at once)
        if self.on and not self.recording and self.steps[0] <= step <= self.steps[-1]:
            self.cuda.record(True)
            self.recording = True

    def end(self, step: int) -> Path | None:
        if not self.recording or step not in self.steps:
            return None
        path = self._dump(f"step{step}")
        if step == self.steps[-1]:  # the last chosen step: recording costs time, stop it
            self.cuda.record(False)
            self.recording = False
        return path

    def oom(self) -> Path | None:
        """The allocator's state at an out-of-memory error, before the exit: on every CUDA run (costs
        nothing until then), with the history when recording."""
        return self._dump("oom") if self.cuda_device else None

    def _dump(self, what: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"memory_rank{self.rank}_{what}.pickle"
        self.cuda.dump(str(path))
        return path


class Watch:
    """What the loop watches around each step: the arrivals at collectives (always: the straggler
    figures), the profiler of train.profile_steps and the memory snapshots (each only when asked for).
    `with watch.step(n):` around step n's work."""

    def __init__(self, t, run_dir: str, mesh, probe, all_threads: bool = False):
        observer = probe.watch(mesh)
        self.prof = StepProfiler(t.profile_steps, run_dir, mesh.rank, observer, mesh.device, all_threads)
        self.mem = MemorySnapshots(t.memory_snapshot, run_dir, mesh.rank, mesh.device)
        self.observer, self._step, self._exported = observer, 0, False
        late = sorted(s for s in {*t.profile_steps, *t.memory_snapshot} if s > t.max_steps)
        if late and mesh.rank == 0:  # asked for, never reached: said, not silently skipped
            print(
                f"megaframe: note: steps {late} of train.profile_steps / train.memory_snapshot are past "
                f"train.max_steps={t.max_steps}: not recorded",
                file=sys.stderr,
                flush=True,
            )

    def step(self, step: int):
        self._step = step
        return self

    def __enter__(self):
        self.prof.begin(self._step)
        self.mem.begin(self._step)
        # arrivals are compared inside steps only (a save or an evaluation waits on rank 0's own work),
        # not in a profiled step nor the one after it: each rank's profiler starts and writes its trace
        # in its own time, seconds apart
        self.observer.arrivals = self.prof.prof is None and not self._exported
        self._exported = False
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.observer.arrivals = False
        if kind is None:
            self._exported = self.prof.end(self._step) is not None
            self.mem.end(self._step)
        elif issubclass(kind, torch.OutOfMemoryError):
            self.mem.oom()  # the error goes on: the run exits as before, the snapshot written

    def close(self) -> None:
        self.prof.close()
