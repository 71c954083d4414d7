"""Token dispatch for expert parallelism: permute by expert, all-to-all over ep, run the local experts,
all-to-all back, unpermute and combine.

Legend: T tokens on this rank, K top-k, A = T·K assignments (fewer once capacity drops some),
D hidden, E experts in all, L = E/ep experts on this rank, R rows received from the ep group.

Ep rank r holds experts [r·L, (r+1)·L). Sorting the assignments by expert (stable: ties keep token
order, so the result is deterministic) makes each destination rank's rows contiguous. The per-expert
counts go first (an even all-to-all of E integers), then the rows with those split sizes; the
received rows come ordered (source rank, local expert) and are regrouped by local expert so each
expert runs one GEMM on a contiguous slice. The way back is the exact reverse. Both all-to-alls are
autograd-aware (comm.all_to_all), so gradients take the same route backwards.

The split sizes must be known on the host, so dispatch syncs once per layer and micro-batch (as
Megatron's dropless dispatcher does), and only there: counts are one-hot sums, the capacity cut is a
slice after that sync, the regrouping's sizes come from the host lists (tests/distributed/
test_host_syncs.py counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def dispatch_combine(x_TD: torch.Tensor, p: Plan, ep: Axis, experts, etp: Axis | None = None) -> torch.Tensor:
    """y_TD = sum over a token's kept assignments of weight · expert(x_token); zero rows for tokens
    whose assignments were all dropped. `experts(x_ND, sizes)` runs the L local experts on consecutive
    row blocks of the given sizes. `etp`: the experts' own tensor-parallel axis (`_etp_experts`)."""
    num_experts = p.kept_E.numel()
    local = num_experts // ep.size
    # Counts before rows: the receiver must size its buffer and splits before the row all-to-all.
    recv_E = comm.all_to_all_counts(p.kept_E, ep)  # recv_E[r·L + l]: rows rank r sends to our expert l
    split = etp is not None and etp.size > 1
    # under etp the counts every etp peer received too (its rows are gathered here), in the same sync
    all_recv = comm.all_gather_dim0(recv_E, etp) if split else recv_E
    # Concatenated so all lists cost one device-to-host copy, not two.
    host = torch.cat([p.kept_E, all_recv]).tolist()  # the one host sync: split sizes
    kept, all_host = host[:num_experts], host[num_experts:]
    recv = all_host[etp.rank * num_experts : (etp.rank + 1) * num_experts] if split else all_host
    n = sum(kept)  # the kept assignments lead token_A; the dropped ones are cut here
    token_A, weight_A = p.token_A[:n], p.weight_A[:n]
    x_AD = x_TD[token_A]
    send_splits = [sum(kept[r * local : (r + 1) * local]) for r in range(ep.size)]
    recv_RL = [recv[r * local : (r + 1) * local] for r in range(ep.size)]
    recv_splits = [sum(row) for row in recv_RL]
    x_RD = comm.all_to_all(x_AD, ep, recv_splits, send_splits)
    # each local expert's rows on the device too: the grouped GEMM's group ends, with no host-to-device copy
    ends_L = recv_E.view(ep.size, local).sum(0).cumsum(0)
    if split:
        y_RD = _etp_experts(x_RD, (all_recv, all_host), etp, experts, local)
    elif ep.size > 1:
        perm_R, sizes = _regroup(recv_E, recv_RL)
        y_RD = experts(x_RD[perm_R], sizes, ends_L)
        # Back to (source rank, local expert) order: the return all-to-all's splits assume the arrival order.
        y_RD = y_RD[torch.argsort(perm_R)]
    else:
        y_RD = experts(x_RD, recv_RL[0], ends_L)
    y_AD = comm.all_to_all(y_RD, ep, send_splits, recv_splits)
    # Weighted after the way back, on the token's own rank: the weight's grad (the router's) stays local.
    y_AD = y_AD * weight_A.unsqueeze(-1).to(y_AD.dtype)
    # index_add sums a token's K expert outputs; tokens whose assignments were all dropped stay zero.
    return torch.zeros_like(x_TD).index_add(0, token_A, y_AD)


def _etp_experts(x_RD: torch.Tensor, counts: tuple, etp: Axis, experts, local: int) -> torch.Tensor:
    """The local experts split over etp (column-parallel gate/up, row-parallel down: Megatron's expert
    tensor parallelism): the rows every etp peer received are gathered (all-to-all with uneven splits,
    autograd-aware), each peer runs its slice of the experts on all of them, and the partial outputs go
    back to the rows' own peer, where they are summed. counts: (device, host) rows per (etp peer, ep
    source, local expert), in that order."""
    counts_GE, host = counts
    n, per_peer = x_RD.shape[0], len(host) // etp.size
    rows_J = [sum(host[j * per_peer : (j + 1) * per_peer]) for j in range(etp.size)]
    x_GD = comm.all_to_all(x_RD.repeat(etp.size, 1), etp, rows_J, [n] * etp.size)
    recv_RL = [host[k * local : (k + 1) * local] for k in range(len(host) // local)]
    perm_G, sizes = _regroup(counts_GE, recv_RL)
    ends_L = counts_GE.view(-1, local).sum(0).cumsum(0)
    y_GD = experts(x_GD[perm_G], sizes, ends_L)[torch.argsort(perm_G)]  # partial sums over etp
    y_JND = comm.all_to_all(y_GD, etp, [n] * etp.size, rows_J)
    return y_JND.view(etp.size, n, -1).sum(0)
