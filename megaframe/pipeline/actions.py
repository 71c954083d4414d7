"""The vocabulary of pipeline schedules: compute and transfer action kinds, one `Action`, how receives
are grouped, and where a rank's chunk sits among the virtual stages (a loop or a V)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)


class Grouping(enum.Enum):
    PAIRED = "paired"
    """Receives posted at their message's tick, in the batch of the peer's matching send (NCCL-safe)."""
    ADJACENT = "adjacent"
    """Each receive right before the compute that needs it (deadlocks interleaved schedules on NCCL)."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. For communication, `peer` is the other pipeline rank."""

    kind: str
    microbatch: int
    chunk: int
    peer: int = -1

    def __str__(self) -> str:
        tail = (
            f"->{self.peer}" if self.kind.startswith("SEND") else (f"<-{self.peer}" if self.peer >= 0 else "")
        )
        return f"{self.kind}{self.microbatch}.{self.chunk}{tail}"


def stage_of(rank: int, chunk: int, pp: int, v: bool = False) -> int:
    """The virtual stage of a rank's chunk: chunk·pp + rank in the loop order, a V under zbv."""
    if v:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def locate(stage: int, pp: int, v: bool = False) -> tuple[int, int]:
    """(rank, chunk) holding a virtual stage: the inverse of stage_of."""
    if v:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp
