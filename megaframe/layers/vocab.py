"""Vocab-parallel embedding and cross-entropy: the vocabulary is split over tp, full logits never exist.

Legend: S sequence (S/tp when sequence-parallel), B batch, D hidden, V vocab rows held by this rank (V/tp).
VocabParallelEmbedding: weight [V/tp, D], rows [r·V/tp, (r+1)·V/tp) on tp rank r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megaframe.layers import wgrad
from megaframe.layers.shard import Shard, sharded_param
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


class _RowsIntoMain(torch.autograd.Function):
    """x_ND = w_VD[ids_N]; backward adds only the looked-up rows' grads into w's fp32 main_grad (ZeRO-1 sets
    `rows_into_main` on an untied embedding): N x D elements touched, not autograd's dense V x D grad (zero
    fill, scatter) copied or added into the fp32 buffer by the param's hook (8 / 12 B per element of the
    table per micro-batch). The step's first backward zeroes main_grad first (4 B per element, once)."""

    @staticmethod
    def forward(ctx, ids_N, w_VD, main_VD):
        ctx.save_for_backward(ids_N)
        ctx.main = main_VD  # on ctx: written by every micro-batch's backward in between (see wgrad.py)
        ctx.shape = w_VD.shape
        return F.embedding(ids_N, w_VD)

    @staticmethod
    def backward(ctx, g_ND):
        (ids_N,) = ctx.saved_tensors
        main = ctx.main
        if wgrad.note_written(main):
            main.zero_()
        # accumulate=True sums repeated ids (deterministic: CUDA's index_put_ sorts the indices)
        main.index_put_((ids_N,), g_ND.to(main.dtype), accumulate=True)
        wgrad.pending.add(main.data_ptr())
        # fires the param's hook, which drops it (the grad is in main already); never read or written
        return None, torch.empty(ctx.shape, dtype=g_ND.dtype, device=g_ND.device), None


def embedding(ids: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """F.embedding, with the grad's rows added into w's fp32 main_grad where the optimizer set
    rows_into_main."""
    if not (getattr(w_VD, "rows_into_main", False) and torch.is_grad_enabled() and w_VD.requires_grad):
        return F.embedding(ids, w_VD)
    x_ND = _RowsIntoMain.apply(ids.reshape(-1), w_VD, w_VD.main_grad)
    return x_ND.view(*ids.shape, w_VD.shape[1])


class VocabParallelEmbedding(nn.Module):
    """Lookup in this rank's vocab rows, zero elsewhere,
    then sum over tp (reduce-scatter over seq under sp)."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        tp: Axis,
        sp: bool,
        device=None,
        pp_tied: bool = False,
        pp_duplicate: bool = False,
    ):
        super().__init__()
        self.tp, self.sp = tp, sp
        self.weight = sharded_param(
            Shard((vocab, dim), 0, (vocab,), tp.rank, tp.size),
            device,
            pp_tied=pp_tied,
            pp_duplicate=pp_duplicate,
            role="embedding",
        )
        self.start = tp.rank * (vocab // tp.size)
        self.end = self.start + vocab // tp.size

    def forward(self, ids_SB: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding(ids_SB, self.weight)
        outside_SB = (ids_SB < self.start) | (ids_SB >= self.end)
        # Map outside ids to row 0 so the lookup stays in bounds, then zero those rows: the sum over tp
        # leaves exactly one rank's row per token.
        local_SB = (ids_SB - self.start).masked_fill(outside_SB, 0)
        x_SBD = embedding(local_SB, self.weight).masked_fill(outside_SB.unsqueeze(-1), 0.0)
        return comm.reduce_scatter_to_sp(x_SBD, self.tp) if self.sp else comm.reduce_from_tp(x_SBD, self.tp)


def parallel_logits(
    x_SBD: torch.Tensor, weight_VD: torch.Tensor, tp: Axis, sp: bool, gemm=None
) -> torch.Tensor:
    """logits_SBV for this rank's vocab rows; x all-gathered over seq under sp, else copied to tp. `gemm`: an
    Fp8Gemm (train.precision=fp8, layers/fp8.py) instead of the bf16 GEMM."""
    x_SBD = comm.gather_from_sp(x_SBD, tp) if sp else comm.copy_to_tp(x_SBD, tp)
    return F.linear(x_SBD, weight_VD) if gemm is None else gemm(x_SBD, weight_VD)


class _VocabParallelCE(torch.autograd.Function):
    """forward: per-token -log softmax(target) with max, target logit and sum-exp reduced over tp.

    backward: softmax - onehot(target) on this rank's vocab rows (no communication).
    """

    @staticmethod
    def forward(ctx, logits_SBV, target_SB, tp: Axis):
        # fp32 for exp and the sums: bf16 logits would lose the loss's small differences.
        logits_SBV = logits_SBV.float()
        vocab = logits_SBV.shape[-1]
        start = tp.rank * vocab
        # Log-sum-exp shift by the GLOBAL max: every rank must subtract the same value, or the summed
        # exps of different ranks would be on different scales. It also keeps exp() from overflowing.
        max_SB = logits_SBV.max(dim=-1).values
        comm.all_reduce(max_SB, tp, op=dist.ReduceOp.MAX)
        shifted_SBV = logits_SBV - max_SB.unsqueeze(-1)
        outside_SB = (target_SB < start) | (target_SB >= start + vocab)
        local_SB = (target_SB - start).masked_fill(outside_SB, 0)
        # Only the rank holding the target's row contributes its logit; the others add 0 in the sum below.
        picked_SB = shifted_SBV.gather(-1, local_SB.unsqueeze(-1)).squeeze(-1).masked_fill(outside_SB, 0.0)
        exp_SBV = shifted_SBV.exp()
        # one all-reduce for both sums: [target logit, sum of exp]
        both_2SB = comm.all_reduce(torch.stack([picked_SB, exp_SBV.sum(dim=-1)]), tp)
        loss_SB = torch.log(both_2SB[1]) - both_2SB[0]
        exp_SBV.div_(both_2SB[1].unsqueeze(-1))  # now the softmax, kept for backward
        ctx.save_for_backward(exp_SBV, local_SB, outside_SB)
        return loss_SB

    @staticmethod
    def backward(ctx, g_SB):
        softmax_SBV, local_SB, outside_SB = ctx.saved_tensors
        grad_SBV = softmax_SBV  # in place: the saved softmax is ours and backward runs once
        # -1 at the target on the rank that holds it; 0 (a no-op add at the clamped index) on the others.
        grad_SBV.scatter_add_(-1, local_SB.unsqueeze(-1), (outside_SB.float() - 1.0).unsqueeze(-1))
        grad_SBV.mul_(g_SB.unsqueeze(-1))
        return grad_SBV, None, None


def log_softmax_nll(logits_XV: torch.Tensor, target_X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-probabilities, per-token loss = -logp[target]) with torch's fused log_softmax (one pass
    over the logits instead of max, subtract, exp, sum, divide). X: any leading token dims."""
    # fp32: log_softmax's internal log-sum-exp and the saved logp feed the grad; bf16 would round both.
    logp_XV = torch.log_softmax(logits_XV.float(), dim=-1)
    return logp_XV, -logp_XV.gather(-1, target_X.unsqueeze(-1)).squeeze(-1)


def nll_grad_(logp_XV: torch.Tensor, target_X: torch.Tensor, g_X: torch.Tensor | None = None) -> torch.Tensor:
    """The loss's grad w.r.t. the logits, softmax - onehot (times g_X), written over logp_XV in place:
    no new V-wide buffer, no zero-filled one-hot. The caller must not need logp afterwards."""
    grad_XV = logp_XV.exp_()  # exp(log_softmax) is the softmax, without a second pass over the logits
    grad_XV.scatter_add_(-1, target_X.unsqueeze(-1), grad_XV.new_full((*target_X.shape, 1), -1.0))
    return grad_XV if g_X is None else grad_XV.mul_(g_X.unsqueeze(-1))


class _CrossEntropy(torch.autograd.Function):
    """tp = 1: loss = -log_softmax(logits)[target]; backward reuses the saved log-probabilities."""

    @staticmethod
    def forward(ctx, logits_SBV, target_SB):
        logp_SBV, loss_SB = log_softmax_nll(logits_SBV, target_SB)
        ctx.save_for_backward(logp_SBV, target_SB)
        return loss_SB

    @staticmethod
    def backward(ctx, g_SB):
        logp_SBV, target_SB = ctx.saved_tensors
        return nll_grad_(logp_SBV, target_SB, g_SB), None  # in place: backward runs once


def vocab_parallel_cross_entropy(logits_SBV: torch.Tensor, target_SB: torch.Tensor, tp: Axis) -> torch.Tensor:
    """Per-token loss_SB from vocab-split logits; equals F.cross_entropy on the gathered logits."""
    if tp.size == 1:
        return _CrossEntropy.apply(logits_SBV, target_SB)
    return _VocabParallelCE.apply(logits_SBV, target_SB, tp)
