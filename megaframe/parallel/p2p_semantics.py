"""NCCL's point-to-point rules emulated on gloo, so the CPU suite fails where a GPU run would.

gloo is kinder than NCCL (DESIGN §1.3c): `batch_isend_irecv` returns one Work per op, every op runs on
its own, and a receive buffer is written as soon as the data arrives. With
`MEGAFRAME_P2P_SEMANTICS=nccl` (read once when the mesh is built) the pipeline axis carries an
`NcclStream` and `comm.batch_isend_irecv` goes through it instead:

- a batch returns ONE coalesced Work (torch's `_coalescing_manager` on NCCL);
- the batches of one group run in order, one after the other, on one background thread per group
  (NCCL's one stream per communicator): a batch's receives are posted only once every earlier batch
  of the group has completed;
- a send completes only once the peer has posted the matching receive (rendezvous): the receiver
  sends a one-element "ready" message when its batch starts, and the sender's batch completes only
  once it has that message; so a schedule whose batches wait on each other in a ring really
  deadlocks, and then the group's timeout fires;
- a receive buffer holds NaN until its Work is waited on: the data lands in a private buffer and is
  copied into the caller's tensor by `wait()` (a compute stream reading before the wait reads garbage).

Messages between two ranks match in posting order (one FIFO per pair, whatever the direction, as on
NCCL, which has no tags); the ready messages use their own tag.
"""

from __future__ import annotations

import datetime
import enum
import os
import queue
import threading

import torch
import torch.distributed as dist

ENV_VAR = "MEGAFRAME_P2P_SEMANTICS"
_DATA_TAG, _READY_TAG = 0, 7
_FALLBACK_TIMEOUT_S = 600.0


class P2PSemantics(enum.Enum):
    NATIVE = "native"
    """The backend's own (gloo on CPU, NCCL on GPU)."""
    NCCL = "nccl"
    """NCCL's rules emulated on the backend (see the module docstring)."""


def semantics_from_env() -> P2PSemantics:
    """The mode named by MEGAFRAME_P2P_SEMANTICS (default native); read once, where the mesh is built."""
    value = os.environ.get(ENV_VAR, P2PSemantics.NATIVE.value).strip().lower() or P2PSemantics.NATIVE.value
    try:
        return P2PSemantics(value)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={value!r} must be one of {[s.value for s in P2PSemantics]}") from None


def group_timeout_s(group) -> float:
    """The shorter of the group's and the default group's timeouts: a group made by new_group without a
    timeout keeps torch's 30-minute default, and a test must fail well before that."""
    out = []
    for pg in (group, dist.group.WORLD):
        try:
            out.append(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        except (AttributeError, RuntimeError):  # a backend without options (or no CPU backend)
            continue
    return min(out) if out else _FALLBACK_TIMEOUT_S


class CoalescedWork:
    """The one Work of a batch: done once every send and receive of the batch is; `wait()` then copies
    the received data into the caller's tensors (before that they hold NaN)."""

    def __init__(self, sends, recvs, timeout_s: float):
        self.sends = sends  # (tensor, global peer rank)
        self.recvs = [(t, peer, torch.empty_like(t)) for t, peer in recvs]  # (caller's, peer, private)
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._delivered = False
        for t, _, _ in self.recvs:
            if t.is_floating_point():
                with torch.no_grad():
                    t.fill_(float("nan"))

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # the stream thread's own waits time out after the group's timeout; the margin lets it report first
        limit = timeout.total_seconds() if timeout is not None else self.timeout_s + 30
        if not self.done.wait(limit):
            raise RuntimeError(f"p2p batch not complete after {limit:.0f}s (NCCL semantics: a deadlock?)")
        if self.error is not None:
            raise RuntimeError(f"p2p batch failed under NCCL semantics: {self.error}") from self.error
        if not self._delivered:
            with torch.no_grad():
                for t, _, private in self.recvs:
                    t.copy_(private)
            self._delivered = True
        return True

    def _run(self, group, ready: torch.Tensor) -> None:
        """All ops of the batch at once (NCCL runs a group's ops together); returns once all are done."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # posted: tell each sender its message may complete; then the data can land
        works = [dist.isend(ready, peer, group=group, tag=_READY_TAG) for _, peer, _ in self.recvs]
        works += [dist.irecv(private, peer, group=group, tag=_DATA_TAG) for _, peer, private in self.recvs]
        works += [dist.isend(t, peer, group=group, tag=_DATA_TAG) for t, peer in self.sends]
        # rendezvous: a send is complete only once its receiver has posted the receive
        works += [dist.irecv(torch.empty(1), peer, group=group, tag=_READY_TAG) for _, peer in self.sends]
        for w in works:
            w.wait(timeout)


def stream_for(group, emulate: bool) -> "NcclStream | None":
    """The pp group's emulated stream, or None (the backend's own semantics). Only gloo is emulated: on an
    NCCL group the real rules already hold, and the emulation would send its CPU "ready" tensors over
    NCCL, which takes CUDA tensors only (the CPU suite's MEGAFRAME_P2P_SEMANTICS=nccl reaching a GPU run)."""
    if not emulate or group is None or dist.get_backend(group) != "gloo":
        return None
    return NcclStream(group, group_timeout_s(group))


class NcclStream:
    """One group's in-order p2p stream: batches run one after another on a background thread."""

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._ready = torch.ones(1)

    def submit(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
    ) -> CoalescedWork:
        """Queue one batch ((tensor, global peer rank) pairs); returns its single Work at once."""
        work = CoalescedWork(sends, recvs, self.timeout_s)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nccl-p2p-stream", daemon=True)
            self._thread.start()
        self._queue.put(work)
        return work

    def _loop(self) -> None:
        while True:
            work = self._queue.get()
            if self._failed is None:  # after a failure the communicator is gone, as NCCL aborts it
                try:
                    work._run(self.group, self._ready)
                except RuntimeError as e:  # gloo's timeout or a closed peer
                    self._failed = e
            work.error = self._failed
            work.done.set()
