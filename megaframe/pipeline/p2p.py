"""Point-to-point transfers between neighbouring pipeline ranks, batched and counted.

The sends and receives of one step of a schedule go out as one batch (`comm.batch_isend_irecv`);
the schedule pairs each send with the receive the peer posts in its batch of the same step
(schedule.py), which NCCL's rendezvous sends and in-order stream require. A batch with receives is
waited for at once (the next compute reads them). What is waited on is every Work the backend
returned: one per op on gloo, ONE for the whole batch on NCCL, which also covers the batch's sends.
"""
from __future__ import annotations

import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


def warm_up(pp: Axis, device: torch.device) -> None:
    """Create the point-to-point channels to both neighbours now, all ranks together.

    NCCL builds a pair's communicator lazily at its first transfer; if two ranks first meet inside
    different schedule phases that can deadlock, so every rank exchanges a scalar with both
    neighbours up front, in one batch.
    """
    if pp.size == 1:
        return
    nxt, prv = (pp.rank + 1) % pp.size, (pp.rank - 1) % pp.size
    send, recv_n, recv_p = torch.zeros(1, device=device), torch.empty(1, device=device), torch.empty(1, device=device)
    for w in comm.batch_isend_irecv(pp, [(send, nxt), (send, prv)], [(recv_p, prv), (recv_n, nxt)]):
        w.wait()
    pp.stats.pop()  # the warm-up is no step's traffic


def exchange(pp: Axis, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Issue sends and receives (tensor, peer pipeline rank) as one batch; wait for it if it receives.

    Returns the Works still in flight (a batch of sends only), for the caller to wait on before the end
    of its schedule; the sent tensors must stay unmodified until then (the Works hold their storage).
    """
    works = comm.batch_isend_irecv(pp, sends, recvs)
    if not recvs:
        return works
    for w in works:  # all of them: on NCCL the one Work covers the receives and the sends
        w.wait()
    return []
