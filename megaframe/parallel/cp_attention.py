"""Causal attention of a cp rank's queries against the gathered K/V without a mask tensor
(cp_comm=allgather, attention dropout off; Megatron / Transformer Engine's per-chunk attention).

A cp rank holds global chunks r and 2c-1-r (context.py). Query chunk g sees exactly the global chunks
0..g, chunk g itself causally: with K/V in global order that is K/V[:(g+1)·n] under a bottom-right
aligned causal mask, n = S/(2c). Per query chunk:

  CPU (and meta, the planner's device): two calls of SDPA's CPU flash kernel, full visibility on the
    earlier chunks K/V[:g·n] and is_causal on the diagonal chunk, merged by log-sum-exp. The kernel
    returns the row log-sum-exp; backward runs the kernel's own backward on each part with the merged
    output and log-sum-exp (FlashAttention's identity: a part's P = exp(s - lse) and
    delta = rowsum(dO ⊙ O) are those of the whole softmax), so both passes are exact.
  other devices: SDPA with torch.nn.attention.bias.causal_lower_right, which CUDA's flash and
    memory-efficient kernels apply in the kernel (no mask; torch materialises one only where neither
    kernel applies).

Saved for backward: q, the global-order K/V, the output and the fp32 log-sum-exp [B, H, Q]: what one
fused SDPA call saves, and no [Q, T] tensor. The work is the causal triangle's, as with the mask.

Legend: B batch, H query heads, K kv heads (GQA: H a multiple of K), Q this rank's 2n query tokens,
T = S the gathered tokens, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaframe.parallel.eager import eager

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def cp_global_order(x_BKTE: torch.Tensor, cp: int) -> torch.Tensor:
    """The gathered K (or V) in cp-rank order (rank 0's two chunks, rank 1's, ...) put in global order
    along dim 2: global chunk j is gathered chunk 2j (j < c) or 2(2c-1-j)+1 (j >= c)."""
    parts = x_BKTE.chunk(2 * cp, dim=2)
    return torch.cat(
        [parts[2 * j] if j < cp else parts[2 * (2 * cp - 1 - j) + 1] for j in range(2 * cp)], dim=2
    )


def cp_query_segments(seq: int, cp: int, rank: int) -> list[tuple[int, int, int]]:
    """(row lo, row hi, first key of the diagonal chunk) for each of the rank's two query chunks: the
    rows see keys [0, diagonal) fully and the diagonal chunk [diagonal, diagonal + n) causally."""
    n = seq // (2 * cp)
    return [(0, n, rank * n), (n, 2 * n, (2 * cp - 1 - rank) * n)]


class _CpuChunkedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHQE, k_BKTE, v_BKTE, segments):
        o_BHQE = torch.empty_like(q_BHQE)
        # the kernel's lse dtype: fp32, fp64 for fp64 inputs
        lse_dtype = torch.float64 if q_BHQE.dtype == torch.float64 else torch.float32
        lse_BHQ = torch.empty(q_BHQE.shape[:-1], dtype=lse_dtype, device=q_BHQE.device)
        n = segments[0][1] - segments[0][0]
        for lo, hi, d in segments:
            q = q_BHQE[:, :, lo:hi]
            o_diag, lse_diag = _FLASH(q, k_BKTE[:, :, d : d + n], v_BKTE[:, :, d : d + n], 0.0, True)
            if d == 0:  # the sequence's first chunk: nothing earlier to merge
                o_BHQE[:, :, lo:hi], lse_BHQ[:, :, lo:hi] = o_diag, lse_diag
                continue
            o_full, lse_full = _FLASH(q, k_BKTE[:, :, :d], v_BKTE[:, :, :d], 0.0, False)
            lse = torch.logaddexp(lse_full, lse_diag)
            # every row sees at least itself: both parts' lse are finite, no empty-row guard needed
            w_full, w_diag = (lse_full - lse).exp()[..., None], (lse_diag - lse).exp()[..., None]
            o = o_full.to(lse.dtype) * w_full + o_diag.to(lse.dtype) * w_diag
            o_BHQE[:, :, lo:hi], lse_BHQ[:, :, lo:hi] = o, lse
        ctx.save_for_backward(q_BHQE, k_BKTE, v_BKTE, o_BHQE, lse_BHQ)
        ctx.segments = segments
        return o_BHQE

    @staticmethod
    def backward(ctx, do_BHQE):
        q_BHQE, k_BKTE, v_BKTE, o_BHQE, lse_BHQ = ctx.saved_tensors
        n = ctx.segments[0][1] - ctx.segments[0][0]
        dq_BHQE = torch.empty_like(q_BHQE)
        # fp32 accumulators: a key chunk gets grads from up to four kernel calls
        acc = torch.float64 if k_BKTE.dtype == torch.float64 else torch.float32
        dk_BKTE = torch.zeros_like(k_BKTE, dtype=acc)
        dv_BKTE = torch.zeros_like(v_BKTE, dtype=acc)
        do_BHQE = do_BHQE.contiguous()
        for lo, hi, d in ctx.segments:
            q, do, o = q_BHQE[:, :, lo:hi], do_BHQE[:, :, lo:hi], o_BHQE[:, :, lo:hi]
            lse = lse_BHQ[:, :, lo:hi].contiguous()
            # each part with the merged o and lse: its probabilities and delta are the whole softmax's
            dq, dk, dv = _FLASH_BWD(
                do, q, k_BKTE[:, :, d : d + n], v_BKTE[:, :, d : d + n], o, lse, 0.0, True
            )
            dk_BKTE[:, :, d : d + n] += dk
            dv_BKTE[:, :, d : d + n] += dv
            if d > 0:
                dq_full, dk, dv = _FLASH_BWD(do, q, k_BKTE[:, :, :d], v_BKTE[:, :, :d], o, lse, 0.0, False)
                dq = dq.to(acc) + dq_full.to(acc)
                dk_BKTE[:, :, :d] += dk
                dv_BKTE[:, :, :d] += dv
            dq_BHQE[:, :, lo:hi] = dq
        return dq_BHQE, dk_BKTE.to(k_BKTE.dtype), dv_BKTE.to(v_BKTE.dtype), None


@eager  # a custom kernel pair with a hand-written backward: eager between compiled pieces
def cp_chunked_attention(
    q_BHQE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, seq: int, cp: int, rank: int
) -> torch.Tensor:
    """Exact causal attention (no dropout) of cp rank `rank`'s queries against the cp group's gathered
    K/V in cp-rank order (comm.gather_from_cp), without a mask tensor (module docstring)."""
    k_BKTE, v_BKTE = cp_global_order(k_BKTE, cp), cp_global_order(v_BKTE, cp)
    segments = tuple(cp_query_segments(seq, cp, rank))
    if q_BHQE.device.type in ("cpu", "meta"):
        return _CpuChunkedCausal.apply(q_BHQE, k_BKTE, v_BKTE, segments)
    return lower_right_sdpa(q_BHQE, k_BKTE, v_BKTE, segments)


def lower_right_sdpa(
    q_BHQE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, segments
) -> torch.Tensor:
    """The per-chunk calls for devices with a bottom-right causal kernel (K/V in global order). Exact on
    any device (CPU materialises the mask; the unit test runs it there)."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for lo, hi, d in segments:
        end = d + hi - lo
        q, k, v = q_BHQE[:, :, lo:hi], k_BKTE[:, :, :end], v_BKTE[:, :, :end]
        gqa = q.shape[1] != k.shape[1]
        if gqa and not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)):
            # the memory-efficient kernel (fp32) takes no GQA: without whole heads torch would fall back
            # to a materialised [n, end] mask per call; expanded K/V cost O(S) instead
            k, v = (
                k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                v.repeat_interleave(q.shape[1] // v.shape[1], 1),
            )
            gqa = False
        outs.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(hi - lo, end), enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)
