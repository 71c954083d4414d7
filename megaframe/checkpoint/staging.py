"""Page-locked staging for asynchronous saves: one host buffer, sized to the rank's whole share, reused
by every save of the run.

A pinned tensor per stored tensor went through torch's caching host allocator, which rounds each block
up to a power of two and keeps it for the rest of the run: up to ~2x the rank's checkpoint share held
page-locked for good, and the first save paid a cudaHostAlloc per tensor. Here the copies are views
into one buffer; on CUDA it is ordinary host memory registered with cudaHostRegister (exact size, no
rounding), else (registration refused) one pinned allocation. At most one async save is in flight
(async_save.AsyncSaver waits for the previous writer first), so reusing the buffer is safe.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

ALIGN = 64  # bytes: every view starts aligned for any dtype (and for vectorised copies)


def _cuda_register(buf: torch.Tensor) -> bool:
    """Page-lock `buf` in place (cudaHostRegister); False where the driver refuses."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        return int(err) == 0
    except (RuntimeError, AttributeError, TypeError):
        return False


def _cuda_unregister(buf: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except (RuntimeError, AttributeError, TypeError):
        pass


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in the buffer (ALIGN-aligned), and the buffer's size."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


class PinnedStaging:
    """The host buffer an async save copies into; grows (once, to the new total) if the share grows."""

    def __init__(
        self,
        register: Optional[Callable[[torch.Tensor], bool]] = None,
        unregister: Optional[Callable[[torch.Tensor], None]] = None,
    ):
        self.register, self.unregister = register or _cuda_register, unregister or _cuda_unregister
        self.buf: Optional[torch.Tensor] = None
        self.registered = False
        self.allocations = 0  # how many buffers were made (a steady run makes one)

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped and typed like `tensors`, carved out of the one buffer (contents undefined)."""
        offsets, total = layout(tensors)
        if self.buf is None or self.buf.numel() < total:
            self._grow(total)
        return [
            self.buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors)
        ]

    def _grow(self, total: int) -> None:
        self.release()
        buf = torch.empty(max(total, 1), dtype=torch.uint8)
        self.registered = self.register(buf)
        if not self.registered:  # one pinned block from torch's allocator: rounded once, not per tensor
            buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.buf, self.allocations = buf, self.allocations + 1

    def release(self) -> None:
        if self.buf is not None and self.registered:
            self.unregister(self.buf)
        self.buf, self.registered = None, False
