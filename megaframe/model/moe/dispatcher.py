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
Megatron's dropless dispatcher does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


@dataclass
class Plan:
    """Where each kept assignment goes: sorted by expert, with its token and its combine weight."""

    token_A: torch.Tensor
    """Token index of each kept assignment, in expert order."""
    weight_A: torch.Tensor
    """Its combine weight (fp32, differentiable)."""
    kept_E: torch.Tensor
    """Kept assignments per expert (int64)."""
    dropped: torch.Tensor
    """Assignments dropped by the capacity limit (int64 scalar; 0 when dropless)."""


def plan(experts_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, capacity: int | None = None,
         offset_E: torch.Tensor | None = None) -> Plan:
    """Sort assignments by expert; with a capacity, keep each expert's first `capacity` assignments in
    token order. `offset_E`: assignments per expert on earlier sequence blocks of the micro-batch (the
    tp ranks before this one under sp), so the cut is the one a single process would make."""
    k = experts_TK.shape[1]
    flat_A = experts_TK.reshape(-1)
    order_A = torch.argsort(flat_A, stable=True)
    sorted_A = flat_A[order_A]
    counts_E = torch.bincount(flat_A, minlength=num_experts)
    dropped = torch.zeros((), dtype=torch.int64, device=flat_A.device)
    if capacity is not None:
        starts_E = counts_E.cumsum(0) - counts_E
        pos_A = torch.arange(flat_A.numel(), device=flat_A.device) - starts_E[sorted_A]
        if offset_E is not None:
            pos_A = pos_A + offset_E[sorted_A]
        keep_A = pos_A < capacity
        dropped = (~keep_A).sum()
        order_A, sorted_A = order_A[keep_A], sorted_A[keep_A]
        counts_E = torch.bincount(sorted_A, minlength=num_experts)
    return Plan(order_A // k, weights_TK.reshape(-1)[order_A], counts_E, dropped)


def _regroup(recv_counts_RL: list[list[int]], device) -> tuple[torch.Tensor, list[int]]:
    """Permutation taking rows ordered (source rank, local expert) to (local expert, source rank), and
    the rows per local expert."""
    counts = torch.tensor(recv_counts_RL, dtype=torch.int64, device=device)
    local = counts.shape[1]
    expert_R = torch.repeat_interleave(torch.arange(local, device=device).repeat(counts.shape[0]), counts.reshape(-1))
    return torch.argsort(expert_R, stable=True), counts.sum(0).tolist()


def dispatch_combine(x_TD: torch.Tensor, p: Plan, ep: Axis, experts) -> torch.Tensor:
    """y_TD = sum over a token's kept assignments of weight · expert(x_token); zero rows for tokens
    whose assignments were all dropped. `experts(x_ND, sizes)` runs the L local experts on consecutive
    row blocks of the given sizes."""
    num_experts = p.kept_E.numel()
    local = num_experts // ep.size
    x_AD = x_TD[p.token_A]
    recv_E = comm.all_to_all_counts(p.kept_E, ep)  # recv_E[r·L + l]: rows rank r sends to our expert l
    kept, recv = torch.stack([p.kept_E, recv_E]).tolist()  # the one host sync
    send_splits = [sum(kept[r * local:(r + 1) * local]) for r in range(ep.size)]
    recv_RL = [recv[r * local:(r + 1) * local] for r in range(ep.size)]
    recv_splits = [sum(row) for row in recv_RL]
    x_RD = comm.all_to_all(x_AD, ep, recv_splits, send_splits)
    if ep.size > 1:
        perm_R, sizes = _regroup(recv_RL, x_TD.device)
        y_RD = experts(x_RD[perm_R], sizes)
        y_RD = y_RD[torch.argsort(perm_R)]
    else:
        y_RD = experts(x_RD, recv_RL[0])
    y_AD = comm.all_to_all(y_RD, ep, send_splits, recv_splits)
    y_AD = y_AD * p.weight_A.unsqueeze(-1).to(y_AD.dtype)
    return torch.zeros_like(x_TD).index_add(0, p.token_A, y_AD)
