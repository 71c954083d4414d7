"""The overlapped kinds' pair (pipeline/schedule.py: ScheduleSpec.overlap): a forward and another
micro-batch's backward run at once, the forward on a worker thread and the backward on the calling one,
each on its own lane of communicators (parallel/lanes.py), so the all-to-alls of one overlap the other's
compute. Megatron's moe_a2a_overlap interleaves the two by hand, layer by layer, on one thread; here the
waits of each thread's collectives leave the device and the host to the other.

What the two share is only read by both or written by one: the weights (read); the grads, written by the
backward, but for the fused head's dW, which its forward sums into main_grad (so the head's backward writes
its check into grad x, not there: layers/fused_ce.py); the model's per-step statistics (written by the
forward only); the executor's maps (keys of different micro-batches). The default random streams are drawn
by forwards only, which keep their order: the ring attention's backward draws its mask again from a
generator of its own (parallel/ring_attention.py). The worker saves its tensors under the caller's
saved-tensor hooks (a thread starts without any). A profiled step records every thread
(training/profiling.py); the straggler figures keep each lane's collectives apart (parallel/observe.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from megaframe.parallel import lanes


class Pairs:
    """Runs the pairs of one schedule and gives each (micro-batch, chunk) its lane."""

    def __init__(self, paired: frozenset[int], device: torch.device):
        self.paired, self.device = paired, device
        self.lane: dict[tuple[int, int], int] = {}
        self._pool: ThreadPoolExecutor | None = None

    def alone(self, forward: bool, key: tuple[int, int]) -> int:
        """The lane of an action run alone: a forward's is lane 0, a backward's its forward's."""
        if forward:
            self.lane[key] = 0
        return self.lane[key]

    def run(self, forward: Callable[[], None], backward: Callable[[], None], f_key, b_key):
        """forward (of micro-batch, chunk `f_key`) on the worker and backward (`b_key`'s) here, each on its
        lane: the forward on the other lane than the backward's; returns both (start, end) times."""
        if self._pool is None:
            # one worker for the step's pairs: a thread per pair would cost its start each time
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megaframe-forward")
        b_lane = self.lane[b_key]
        f_lane = self.lane[f_key] = 1 - b_lane
        future = self._pool.submit(_timed, forward, f_lane, self.device, True, _saved_hooks())
        try:
            b_span = _timed(backward, b_lane, self.device, False)
        finally:
            # the forward's exception (if any) is raised here, after the backward is done with the lanes
            f_span = future.result()
        return f_span, b_span

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _saved_hooks():
    """The calling thread's saved-tensor hooks (pack, unpack), or None: a thread starts without any, and the
    forward on the worker must save its tensors as it would on the caller."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _timed(
    fn: Callable[[], None], lane: int, device: torch.device, stream: bool, hooks=None
) -> tuple[float, float]:
    """fn on `lane`; a forward on the lane's stream too (a backward runs on its forward's streams), under
    the caller's saved-tensor `hooks` where given."""
    t0 = time.perf_counter()
    saving = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
    with lanes.use(lane), lanes.on_stream(lane if stream else 0, device), saving:
        fn()
    return t0, time.perf_counter()
