"""Point-to-point transfers between neighbouring pipeline ranks, batched and counted.

The sends and receives of one step of a schedule go out as one batch (`comm.batch_isend_irecv`);
the schedule pairs each send with the receive the peer posts in its batch of the same step
(schedule.py), which NCCL's rendezvous sends and in-order stream require. A `Transfer` is waited
for right before the first compute that reads one of its receives (on NCCL a wait only orders the
compute stream after the transfer), and what is waited on is every Work the backend returned: one
per op on gloo, ONE for the whole batch on NCCL, which then also covers the batch's sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


@dataclass
class Transfer:
    """One batch in flight. Its sent tensors must stay unmodified until it is waited for (the Works
    hold their storage, so the caller may drop its own references at once)."""

    works: list

    def wait(self) -> None:
        for w in self.works:  # all of them: on NCCL the one Work covers the receives and the sends
            w.wait()


def warm_up(pp: Axis, device: torch.device) -> None:
    """Create the point-to-point channels to both neighbours now, all ranks together.

    NCCL builds a pair's communicator lazily at its first transfer; if two ranks first meet inside
    different schedule phases that can deadlock, so every rank exchanges a scalar with both
    neighbours up front, in one batch.
    """
    if pp.size == 1:
        return
    nxt, prv = (pp.rank + 1) % pp.size, (pp.rank - 1) % pp.size
    # One send buffer for both peers: it is never written, and distinct receive buffers keep the two
    # arrivals from landing on each other when pp = 2 (both neighbours are the same rank).
    send, recv_n, recv_p = (
        torch.zeros(1, device=device),
        torch.empty(1, device=device),
        torch.empty(1, device=device),
    )
    start(pp, [(send, nxt), (send, prv)], [(recv_p, prv), (recv_n, nxt)]).wait()
    pp.stats.pop()  # the warm-up is no step's traffic


def start(pp: Axis, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Transfer:
    """Issue sends and receives (tensor, peer pipeline rank) as one batch; the receives hold their data
    only once the returned Transfer is waited for."""
    return Transfer(comm.batch_isend_irecv(pp, sends, recvs))
