"""Peak memory of each phase of a run (start-up, the first step, the first save, the load of a resume),
measured once and logged as `mem/phase/<name>_peak_bytes` on the next metrics row (a save after the last
row is in the run's closing `memory per phase` line only: a second row of one step would replace the
first for readers that keep a step's later line).

A phase's figure is the most this rank held at any moment of it, everything included (what it already
held when the phase began and the phase's own transients), the quantity the planner predicts per phase
(planning/memory/phases.py) and the one a device's capacity bounds:

  cuda  torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats at the phase's start:
        the caching allocator's own count of the bytes handed to tensors.
  cpu   the bytes held at the phase's start (the rank's state: parameters, gradients and optimizer state
        as memory_figures counts them, once `track` names them; nothing before start-up), plus the peak of
        the running sum of the CPU allocator's events recorded by the kineto profiler (profile_memory,
        AllocatorProfile below). The allocator's events were chosen over a TorchDispatchMode: a dispatch
        mode sees the outputs of the ops called, but neither their frees (storages die in C++, after views
        and autograd let go) nor the scratch a kernel allocates inside itself; the allocator sees every
        allocation and every free of the rank's thread, in order. The profiler costs time while it records,
        which is why each phase is measured once.

Not measured: memory outside tensors (the CUDA context, NCCL's buffers, Python objects, mmap'd data), and on
CPU the tensors of other threads (a loader's, the async checkpoint writer's): the profile follows the thread
that starts it, and threads started from Python do not inherit it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

PHASES = ("startup", "load", "step", "save")
"""In the order a resumed run meets them."""


def key(name: str) -> str:
    return f"mem/phase/{name}_peak_bytes"


class PhaseMeter:
    """begin(name) ... end() around a phase, or `with meter.phase(name):` (measured the first time only);
    take() hands the figures not yet logged."""

    def __init__(self, device: torch.device):
        self.device = device
        self.figures: dict[str, int] = {}
        self.pending: dict[str, int] = {}
        self._state = None
        self._open: tuple[str, int, object] | None = None

    def track(self, model, optimizer) -> None:
        """The rank's state the later phases start from (cpu's baseline): its params, grads and moments."""
        from megaframe.training.metrics import memory_figures

        # ZeRO-3: plus the block params gathered right now (start-up leaves them gathered for a load)
        self._state = lambda: (
            getattr(optimizer, "gathered_params", 0)
            + sum(
                v
                for k, v in memory_figures(model, optimizer, torch.device("cpu")).items()
                if k in ("mem/params_bytes", "mem/grads_bytes", "mem/optim_bytes")
            )
        )

    def begin(self, name: str) -> None:
        if self._open is not None or name in self.figures:  # one phase at a time, each once
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._open = (name, 0, None)
            return
        base = self._state() if self._state is not None else 0
        if torch._C._autograd._profiler_enabled():  # the user's own profiler: ours would end it; unmeasured
            return
        prof = allocator_profile()
        prof.__enter__()
        self._open = (name, base, prof)

    def end(self, keep: bool = True) -> int | None:
        """Close the open phase; its peak is recorded unless
        `keep` is False (a resume that loaded nothing)."""
        if self._open is None:
            return None
        name, base, prof = self._open
        self._open = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            prof.__exit__(None, None, None)
            peak = base + running_peak(prof)
        if keep:
            self.figures[name] = self.pending[key(name)] = int(peak)
        return int(peak) if keep else None

    @contextmanager
    def phase(self, name: str):
        """Measure the block the first time `name` is entered; later entries run unmeasured."""
        measuring = name not in self.figures and self._open is None
        if measuring:
            self.begin(name)
        try:
            yield
        finally:
            if measuring:
                self.end()

    def summary(self) -> str:
        """One line of every phase measured, for the end of the run (a first save at a stop follows the
        last metrics row: it is only here)."""
        parts = [f"{n} {_size(self.figures[n])}" for n in PHASES if n in self.figures]
        return f"memory per phase (peak on this rank): {', '.join(parts)}"

    def take(self) -> dict[str, int]:
        """The figures measured since the last take (each logged once)."""
        out, self.pending = self.pending, {}
        return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def allocator_profile() -> "AllocatorProfile":
    """A CPU profile recording the allocator's events (a context manager; `kineto_results` after it)."""
    return AllocatorProfile()


class AllocatorProfile:
    """The kineto profiler with memory events on and every operator callback off.

    Operator records are not wanted here, and they made the profile unsafe under gloo: a collective started
    while an operator callback is installed carries the profile (its thread-local state) to gloo's worker
    thread, which opens and closes its record there, and a record closed after the profile ended writes into
    freed memory (SIGSEGV in `~TorchOpStorage` or heap corruption, at random, in ranks that measured a phase;
    checked by tests/distributed/planning/test_memory_profile_gloo.py). Listening to one scope no code uses
    (LITE_INTERPRETER) leaves the allocator's events, reported on this thread, as the profile's only content.

    torch.autograd's profiler API rather than torch.profiler's wrapper: the wrapper's start asks
    `hasattr(torch, "_inductor")`, which imports inductor and dynamo (about a third of a one-step run's CPU
    time) into a run that never compiles."""

    def __init__(self):
        self.kineto_results = None

    def __enter__(self) -> "AllocatorProfile":
        import os

        from torch._C._profiler import ProfilerActivity, RecordScope, _ExperimentalConfig
        from torch.autograd import ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler

        # kineto prints a line at each profiler start and stop unless told otherwise (read at its first start)
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")
        # state, record shapes, profile memory, with stack, with flops, with modules, experimental
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        cpu = {ProfilerActivity.CPU}
        _prepare_profiler(config, cpu)
        _enable_profiler(config, cpu, {RecordScope.LITE_INTERPRETER})
        return self

    def __exit__(self, *exc) -> None:
        from torch.autograd import _disable_profiler

        self.kineto_results = _disable_profiler()


def running_peak(prof) -> int:
    """Peak of the running sum of the allocator's [memory] events (bytes allocated minus freed, in time
    order) over a finished profile (allocator_profile's or torch.profiler's): the most held above what
    was live when it began."""
    results = getattr(prof, "profiler", prof).kineto_results
    events = sorted((e for e in results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
