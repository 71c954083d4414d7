"""Token dispatch for expert parallelism: permute by expert, all-to-all over ep, run the local experts,
all-to-all back, unpermute and combine.

Legend: T tokens on this rank, K top-k, A = T·K assignments (fewer once capacity drops some),
D hidden, E experts in all, L = E/ep experts on this rank, R rows received from the ep group.

Ep rank r holds experts [r·L, (r+1)·L). Sorting the assignments by expert (stable: ties keep token
order, so the result is deterministic) makes each destination rank's rows contiguous. The per-expert
counts go first (an even all-to-all of E integers), then the rows with those split sizes; the
received rows come ordered (source rank, local expert) and are regrouped by local expert so each
expert runs one GEMM on a contiguous slice. The way back is the exact reverse. The all-to-alls are
autograd-aware (comm.all_to_all), so gradients take the same route backwards. Each row's combine weight
travels with it and is applied inside the expert (moe/grouped.py), so backward keeps the routed rows once,
as the experts' input: every move here keeps only its indices (moe/rows.py) or its split sizes.

The split sizes must be known on the host, so dispatch syncs once per layer and micro-batch (as
Megatron's dropless dispatcher does), and only there: counts are one-hot sums, the capacity cut is a
slice after that sync, the regrouping's sizes come from the host lists (tests/distributed/
test_host_syncs.py counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.model.moe import rows
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


@dataclass
class Plan:
    """Where each assignment goes: sorted by expert, with its token and its combine weight.

    The kept assignments come first (kept_E.sum() of them, in expert order), the dropped ones after:
    their number is only known on the host after dispatch's one sync, so the cut is a slice there
    rather than a boolean mask here (which would sync again)."""

    token_A: torch.Tensor
    """Token index of each assignment: the kept ones in expert order, then the dropped ones."""
    weight_A: torch.Tensor
    """Its combine weight (fp32, differentiable)."""
    kept_E: torch.Tensor
    """Kept assignments per expert (int64)."""
    dropped: torch.Tensor
    """Assignments dropped by the capacity limit (int64 scalar; 0 when dropless)."""


def expert_counts(experts_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64) as a one-hot sum: bincount would size its output from the data's
    max on the host (a device sync on CUDA); scatter_add has a fixed size, and integer sums are exact
    whatever the order."""
    return experts_A.new_zeros(num_experts).scatter_add_(0, experts_A, torch.ones_like(experts_A))


def plan(
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None = None,
    offset_E: torch.Tensor | None = None,
    counts_E: torch.Tensor | None = None,
    runs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Plan:
    """Sort assignments by expert; with a capacity, keep each expert's first `capacity` assignments in
    token order. `offset_E`: assignments per expert on earlier sequence blocks of the micro-batch (the
    tp ranks before this one under sp), so the cut is the one a single process would make. `runs`, in
    its place where this rank's tokens are several runs of the micro-batch's token order (cp's two
    chunks): (counts_JE of each run's assignments, before_JE: the micro-batch's assignments per expert
    ahead of each run). `counts_E`: expert_counts(experts_TK) if the caller has it. No host sync."""
    k = experts_TK.shape[1]
    flat_A = experts_TK.reshape(-1)
    # Stable: ties keep token order, so which assignments capacity keeps is deterministic and layout-free.
    order_A = torch.argsort(flat_A, stable=True)
    if counts_E is None:
        counts_E = expert_counts(flat_A, num_experts)
    kept_E, dropped = counts_E, torch.zeros((), dtype=torch.int64, device=flat_A.device)
    if capacity is not None:
        if runs is None:
            runs = (counts_E[None], (torch.zeros_like(counts_E) if offset_E is None else offset_E)[None])
        run_JE, before_JE = runs
        # Earlier tokens used up part of each expert's capacity; clamp: they may have used it all. Runs
        # come in token order, so an expert's kept assignments are still its first ones here (a prefix).
        kept_E = torch.minimum(run_JE, (capacity - before_JE).clamp_min(0)).sum(0)
        dropped = (counts_E - kept_E).sum()
        sorted_A = flat_A[order_A]
        # Rank of each sorted assignment within its expert (index minus the expert's exclusive prefix count).
        pos_A = torch.arange(flat_A.numel(), device=flat_A.device) - (counts_E.cumsum(0) - counts_E)[sorted_A]
        # dropped assignments sort last (key E), kept ones keep their expert order (stable)
        key_A = torch.where(pos_A < kept_E[sorted_A], sorted_A, num_experts)
        order_A = order_A[torch.argsort(key_A, stable=True)]
    return Plan(order_A // k, weights_TK.reshape(-1)[order_A], kept_E, dropped)


def _regroup(recv_E: torch.Tensor, recv_RL: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Permutation taking rows ordered (source rank, local expert) to (local expert, source rank), and
    the rows per local expert. recv_E: the received counts on the device, recv_RL: the same on the host
    (so nothing here syncs: repeat_interleave gets its output size)."""
    ranks, local = len(recv_RL), len(recv_RL[0])
    sizes = [sum(col) for col in zip(*recv_RL)]
    expert_R = torch.repeat_interleave(
        torch.arange(local, device=recv_E.device).repeat(ranks), recv_E, output_size=sum(sizes)
    )
    return torch.argsort(expert_R, stable=True), sizes


@dataclass
class Route:
    """The host split sizes of one dispatch (after its one sync) and the received counts on the device."""

    kept: list[int]
    """Kept assignments per expert (host)."""
    recv_E: torch.Tensor
    """recv_E[r·L + l]: rows ep rank r sends to our local expert l (device)."""
    all_recv: torch.Tensor
    """Under etp, recv_E of every etp peer (device), else recv_E."""
    all_host: list[int]
    """all_recv on the host."""
    recv: list[int]
    """recv_E on the host."""


def route(p: Plan, ep: Axis, etp: Axis | None = None) -> Route:
    """Exchange the per-expert counts over ep (and etp) and bring them to the host: the one sync."""
    # Counts before rows: the receiver must size its buffer and splits before the row all-to-all.
    recv_E = comm.all_to_all_counts(p.kept_E, ep)
    split = etp is not None and etp.size > 1
    # under etp the counts every etp peer received too (its rows are gathered here), in the same sync
    all_recv = comm.all_gather_dim0(recv_E, etp) if split else recv_E
    # Concatenated so all lists cost one device-to-host copy, not two.
    host = torch.cat([p.kept_E, all_recv]).tolist()  # the one host sync: split sizes
    return _route_of(host, p.kept_E.numel(), recv_E, all_recv, etp)


def balanced_route(p: Plan, ep: Axis, etp: Axis | None, capacity: int | None) -> Route:
    """The planner's route (meta tensors: no values, no sync): every expert gets an equal share of each
    rank's assignments, the remainder to the last, at most `capacity` each."""
    e, assigned = p.kept_E.numel(), p.token_A.numel()
    kept = [assigned // e] * e
    kept[-1] += assigned - sum(kept)
    kept = [min(k, capacity) if capacity is not None else k for k in kept]
    recv_E = comm.all_to_all_counts(p.kept_E, ep)  # shapes only on a virtual axis
    split = etp is not None and etp.size > 1
    all_recv = comm.all_gather_dim0(recv_E, etp) if split else recv_E
    # every ep rank sends the same counts: what we receive per (source, local expert) is our slice of kept
    local = e // ep.size
    recv = kept[ep.rank * local : (ep.rank + 1) * local] * ep.size
    return _route_of(kept + recv * (etp.size if split else 1), e, recv_E, all_recv, etp)


def _route_of(host: list[int], e: int, recv_E, all_recv, etp: Axis | None) -> Route:
    kept, all_host = host[:e], host[e:]
    split = etp is not None and etp.size > 1
    recv = all_host[etp.rank * e : (etp.rank + 1) * e] if split else all_host
    return Route(kept, recv_E, all_recv, all_host, recv)


def dispatch_combine(
    x_TD: torch.Tensor, p: Plan, ep: Axis, experts, etp: Axis | None = None, r: Route | None = None
) -> torch.Tensor:
    """y_TD = sum over a token's kept assignments of weight · expert(x_token); zero rows for tokens
    whose assignments were all dropped. `experts(x_ND, sizes, ends_L, w_N1)` runs the L local experts on
    consecutive row blocks of the given sizes, each row weighted by w_N1 inside the expert (moe/grouped.py:
    so no expert output rows are saved for the weights' grad). `etp`: the experts' own tensor-parallel
    axis (`_etp_experts`). `r`: the route, when the caller has it (the planner's balanced one).

    What backward keeps of the routed rows: the experts' input, once. The row moves save only their
    indices (moe/rows.py) and the all-to-alls only their split sizes (comm.all_to_all)."""
    r = route(p, ep, etp) if r is None else r
    local = len(r.kept) // ep.size
    n = sum(r.kept)  # the kept assignments lead token_A; the dropped ones are cut here
    token_A, weight_A1 = p.token_A[:n], p.weight_A[:n].unsqueeze(-1)
    send_splits = [sum(r.kept[k * local : (k + 1) * local]) for k in range(ep.size)]
    recv_RL = [r.recv[k * local : (k + 1) * local] for k in range(ep.size)]
    recv_splits = [sum(row) for row in recv_RL]
    x_RD = comm.all_to_all(rows.gather_rows(x_TD, token_A), ep, recv_splits, send_splits)
    # the combine weights travel with their rows (fp32, 4 bytes a row): the expert applies them
    w_R1 = comm.all_to_all(weight_A1, ep, recv_splits, send_splits)
    # each local expert's rows on the device too: the grouped GEMM's group ends, with no host-to-device copy
    ends_L = r.recv_E.view(ep.size, local).sum(0).cumsum(0)
    if etp is not None and etp.size > 1:
        y_RD = _etp_experts(x_RD, w_R1, (r.all_recv, r.all_host), etp, experts, local)
    elif ep.size > 1:
        perm_R, sizes = _regroup(r.recv_E, recv_RL)
        y_RD = experts(rows.gather_rows(x_RD, perm_R), sizes, ends_L, rows.gather_rows(w_R1, perm_R))
        # Back to (source rank, local expert) order: the return all-to-all's splits assume the arrival order.
        y_RD = rows.scatter_rows(y_RD, perm_R, y_RD.shape[0])
    else:
        y_RD = experts(x_RD, recv_RL[0], ends_L, w_R1)
    y_AD = comm.all_to_all(y_RD, ep, send_splits, recv_splits)
    # sums a token's K weighted expert outputs; tokens whose assignments were all dropped stay zero
    return rows.scatter_rows(y_AD, token_A, x_TD.shape[0])


def _etp_experts(x_RD: torch.Tensor, w_R1: torch.Tensor, counts: tuple, etp: Axis, experts, local: int):
    """The local experts split over etp (column-parallel gate/up, row-parallel down: Megatron's expert
    tensor parallelism): the rows every etp peer received are gathered (all-to-all with uneven splits,
    autograd-aware), each peer runs its slice of the experts on all of them, and the partial outputs go
    back to the rows' own peer, where they are summed. counts: (device, host) rows per (etp peer, ep
    source, local expert), in that order."""
    counts_GE, host = counts
    n, per_peer = x_RD.shape[0], len(host) // etp.size
    rows_J = [sum(host[j * per_peer : (j + 1) * per_peer]) for j in range(etp.size)]
    x_GD = comm.all_to_all(x_RD.repeat(etp.size, 1), etp, rows_J, [n] * etp.size)
    w_G1 = comm.all_to_all(w_R1.repeat(etp.size, 1), etp, rows_J, [n] * etp.size)
    recv_RL = [host[k * local : (k + 1) * local] for k in range(len(host) // local)]
    perm_G, sizes = _regroup(counts_GE, recv_RL)
    ends_L = counts_GE.view(-1, local).sum(0).cumsum(0)
    # each peer's slice of the down projection is weighted too: the partial sums add up to w·down(h)
    y_GD = experts(rows.gather_rows(x_GD, perm_G), sizes, ends_L, rows.gather_rows(w_G1, perm_G))
    y_GD = rows.scatter_rows(y_GD, perm_G, y_GD.shape[0])  # partial sums over etp
    y_JND = comm.all_to_all(y_GD, etp, [n] * etp.size, rows_J)
    return y_JND.view(etp.size, n, -1).sum(0)
