"""Point-to-point transfers between neighbouring pipeline ranks, batched and counted.

Consecutive sends and receives of a schedule go out as one `batch_isend_irecv` (NCCL groups them,
so a rank can send forward and receive backward at once without either blocking the other).
Receives are waited for at once (the next compute needs them); sends stay in flight and are
tracked by the executor, which frees an activation only once its send has completed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaframe.parallel.mesh import Axis


def warm_up(pp: Axis, device: torch.device) -> None:
    """Create the point-to-point channels to both neighbours now, all ranks together.

    NCCL builds a pair's communicator lazily at its first transfer; if two ranks first meet inside
    different schedule phases that can deadlock, so every rank exchanges a scalar with both
    neighbours up front, in one batch.
    """
    if pp.size == 1:
        return
    nxt, prv = pp.ranks[(pp.rank + 1) % pp.size], pp.ranks[(pp.rank - 1) % pp.size]
    send, recv_n, recv_p = torch.zeros(1, device=device), torch.empty(1, device=device), torch.empty(1, device=device)
    ops = [dist.P2POp(dist.isend, send, nxt, group=pp.group), dist.P2POp(dist.irecv, recv_p, prv, group=pp.group),
           dist.P2POp(dist.isend, send, prv, group=pp.group), dist.P2POp(dist.irecv, recv_n, nxt, group=pp.group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def exchange(pp: Axis, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Issue sends and receives (tensor, peer pipeline rank) as one batch; wait for the receives.

    Returns the send works, still in flight.
    """
    ops = [dist.P2POp(dist.isend, t, pp.ranks[peer], group=pp.group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, pp.ranks[peer], group=pp.group) for t, peer in recvs]
    for t, _ in sends:
        pp.stats.add(pp.name, t.numel() * t.element_size())
    if not ops:
        return []
    first = (sends or recvs)[0][0]
    # noted done once the receives arrived; the sends may still be in flight
    with pp.stats.noting(f"p2p send{[p for _, p in sends]} recv{[p for _, p in recvs]}", pp.name, pp.ranks,
                         first.shape, first.dtype, sum(t.numel() * t.element_size() for t, _ in sends + recvs)):
        works = dist.batch_isend_irecv(ops)
        for w in works[len(sends):]:
            w.wait()
    return works[:len(sends)]
