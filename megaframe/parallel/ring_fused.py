"""Ring attention on fused attention kernels (parallel.cp_comm=ring without attention dropout).

The K/V blocks travel the cp ring exactly as in ring_attention.py; what changes is the block attention.
Under cp each rank holds two sequence chunks (context.cp_positions: chunk r and chunk 2c-1-r), so the
causal mask between this rank's queries and one K/V block is made of four chunk pairs, each fully
visible (key chunk before the query chunk), causal on the diagonal (the same chunk: an aligned square)
or invisible. Each visible pair runs one kernel that returns its log-sum-exp: SDPA's flash kernels
(CPU: the flash pair the all-gather path uses; CUDA: flash for bf16/fp16), never materialising the
scores, skipping the invisible pairs and the upper triangle of the diagonal ones. The pair outputs are
merged exactly by log-sum-exp in fp32. Backward runs each pair's flash backward with the FINAL output
and log-sum-exp (FlashAttention's recompute: P = exp(S - lse), delta = rowsum(dO * O)), which gives the
pair's exact share of dQ, dK, dV; the dK/dV accumulator follows its block home as in the math ring.

Document masking (doc_BS, CPU only: CUDA's flash kernels take no mask, so there the math ring runs): each
visible pair also gets an additive mask of "same document" (causal folded in on the diagonal), which
the CPU flash pair takes; a row that sees no key of a pair (its document starts after the pair's keys)
gets lse -inf (the kernel reports 0 for it) and the merge keeps -inf rows at zero weight, never NaN.

Legend: B batch, H query heads, K kv heads, Q this rank's tokens (two chunks of M), N = Q tokens of a
K/V block, E head dim.
"""

from __future__ import annotations

import torch

from megaframe.parallel.mesh import Axis

aten = torch.ops.aten


def fused_kernels(q_BHQE: torch.Tensor) -> bool:
    """Whether this device and dtype have a flash pair returning the log-sum-exp: CPU (any float
    dtype), CUDA for 16-bit types (fp32 on CUDA keeps the math ring)."""
    return q_BHQE.device.type == "cpu" or (q_BHQE.is_cuda and q_BHQE.dtype in (torch.float16, torch.bfloat16))


def _gqa(x_BKME: torch.Tensor, heads: int) -> torch.Tensor:
    # the CPU flash pair takes GQA as is; CUDA's gets K/V expanded (query head h reads kv head h // g)
    return (
        x_BKME if x_BKME.device.type == "cpu" else x_BKME.repeat_interleave(heads // x_BKME.shape[1], dim=1)
    )


def fold_heads(g_BHME: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """GQA in backward: the grads of the query heads sharing
    a kv head summed onto it (also the math ring's)."""
    b, h, m, e = g_BHME.shape
    return g_BHME if h == kv_heads else g_BHME.view(b, kv_heads, h // kv_heads, m, e).sum(2)


def pair_bias(
    docq_BM: torch.Tensor, dock_BM: torch.Tensor, causal: bool, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias_B1MM, seen_B1M) of one chunk pair under document masking: 0 where the query may attend the
    key (same document, and on the diagonal not after it), -inf elsewhere; seen: rows with a visible key."""
    vis = docq_BM[:, :, None] == dock_BM[:, None, :]
    if causal:
        vis = vis & torch.ones(vis.shape[1:], dtype=torch.bool, device=vis.device).tril()
    bias = torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(~vis, float("-inf"))
    return bias.unsqueeze(1), vis.any(-1).unsqueeze(1)


def pair_forward(q, k, v, causal: bool, scale: float, bias=None):
    """(out, lse_fp32, meta) of one chunk pair; meta: what the CUDA backward needs besides the tensors.
    bias: (bias_B1MM, seen_B1M) of document masking (CPU), causal already folded in."""
    if bias is not None:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias[0], scale=scale
        )
        return out, lse.masked_fill(~bias[1], float("-inf")), None
    if q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, _gqa(k, q.shape[1]), _gqa(v, q.shape[1]), 0.0, causal, False, scale=scale
        )
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def pair_backward(do, q, k, v, o, lse, causal: bool, scale: float, meta, bias=None):
    """(dq, dk, dv) of one chunk pair against the final o and lse (dk, dv with K heads)."""
    if bias is not None:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, False, attn_mask=bias[0], scale=scale
        )
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = meta
        h = q.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, _gqa(k, h), _gqa(v, h), o, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
        )
        return dq, fold_heads(dk, k.shape[1]), fold_heads(dv, k.shape[1])
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, scale=scale
    )


def pairs(c: int, r: int, src: int) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) of the visible chunk pairs of rank r's queries against
    rank src's K/V block; slot 0 is chunk r (src), slot 1 chunk 2c-1-r (2c-1-src)."""
    mine, theirs = (r, 2 * c - 1 - r), (src, 2 * c - 1 - src)
    return [(a, b, mine[a] == theirs[b]) for a in range(2) for b in range(2) if theirs[b] <= mine[a]]


def _merge_(
    o_BHME: torch.Tensor, lse_BHM: torch.Tensor, out_BHME: torch.Tensor, lse2_BHM: torch.Tensor
) -> None:
    """o, lse (fp32 views) absorb one more block's (out, lse): the exact softmax merge."""
    new = torch.logaddexp(lse_BHM, lse2_BHM)
    # -inf where neither part saw a key yet (document masking): weigh both by 0, not exp(-inf + inf) = NaN
    ref = new.masked_fill(new.isneginf(), 0)
    o_BHME.mul_(torch.exp(lse_BHM - ref).unsqueeze(-1)).add_(
        out_BHME.float() * torch.exp(lse2_BHM - ref).unsqueeze(-1)
    )
    lse_BHM.copy_(new)


def _pair_bias(doc_BS, c: int, r: int, src: int, a: int, b: int, causal: bool, m: int, dtype):
    """pair_bias of rank r's query chunk slot a against
    rank src's key chunk slot b; None without documents."""
    if doc_BS is None:
        return None
    chunk = (r, 2 * c - 1 - r)[a], (src, 2 * c - 1 - src)[b]
    return pair_bias(
        doc_BS[:, chunk[0] * m : (chunk[0] + 1) * m],
        doc_BS[:, chunk[1] * m : (chunk[1] + 1) * m],
        causal,
        dtype,
    )


class FusedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHQE, k_BKNE, v_BKNE, axis: Axis, overlap: bool, exchange, wait, doc_BS=None):
        c, r, m = axis.size, axis.rank, q_BHQE.shape[2] // 2
        scale = q_BHQE.shape[-1] ** -0.5
        o = torch.zeros_like(q_BHQE, dtype=torch.float32)
        lse = torch.full(q_BHQE.shape[:-1], float("-inf"), device=q_BHQE.device)
        kv, metas = torch.stack([k_BKNE, v_BKNE]), {}
        for j in range(c):
            works = []
            if j < c - 1 and overlap:  # the next block's transfer overlaps this block's kernels
                nxt, works = exchange(axis, kv)
            for a, b, causal in pairs(c, r, (r - j) % c):
                rows, cols = slice(a * m, (a + 1) * m), slice(b * m, (b + 1) * m)
                bias = _pair_bias(doc_BS, c, r, (r - j) % c, a, b, causal, m, q_BHQE.dtype)
                out, blk_lse, metas[(j, a, b)] = pair_forward(
                    q_BHQE[:, :, rows].contiguous(),
                    kv[0][:, :, cols].contiguous(),
                    kv[1][:, :, cols].contiguous(),
                    causal,
                    scale,
                    bias,
                )
                _merge_(o[:, :, rows], lse[:, :, rows], out, blk_lse)
            if j < c - 1 and not overlap:
                nxt, works = exchange(axis, kv)
            wait(works)
            if j < c - 1:
                kv = nxt
        out = o.to(q_BHQE.dtype)
        ctx.save_for_backward(q_BHQE, k_BKNE, v_BKNE, out, lse, doc_BS)
        ctx.axis, ctx.overlap, ctx.exchange, ctx.wait, ctx.metas = axis, overlap, exchange, wait, metas
        return out

    @staticmethod
    def backward(ctx, do_BHQE):
        q_BHQE, k_BKNE, v_BKNE, out, lse, doc_BS = ctx.saved_tensors
        axis, exchange, wait = ctx.axis, ctx.exchange, ctx.wait
        c, r, m = axis.size, axis.rank, q_BHQE.shape[2] // 2
        scale = q_BHQE.shape[-1] ** -0.5
        do = do_BHQE.contiguous()
        rows_of = [slice(0, m), slice(m, 2 * m)]
        # per query chunk, contiguous once: every pair of the ring reads them
        q_, do_, o_, lse_ = ([t[:, :, s].contiguous() for s in rows_of] for t in (q_BHQE, do, out, lse))
        dq = torch.zeros_like(q_BHQE, dtype=torch.float32)
        kv = torch.stack([k_BKNE, v_BKNE])
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for j in range(c):
            works = []
            if j < c - 1 and ctx.overlap:  # the K/V block moves on while its grads are computed here
                nxt, works = exchange(axis, kv)
            for a, b, causal in pairs(c, r, (r - j) % c):
                cols = slice(b * m, (b + 1) * m)
                bias = _pair_bias(doc_BS, c, r, (r - j) % c, a, b, causal, m, q_BHQE.dtype)
                gq, gk, gv = pair_backward(
                    do_[a],
                    q_[a],
                    kv[0][:, :, cols].contiguous(),
                    kv[1][:, :, cols].contiguous(),
                    o_[a],
                    lse_[a],
                    causal,
                    scale,
                    ctx.metas[(j, a, b)],
                    bias,
                )
                dq[:, :, rows_of[a]] += gq
                dkv[0][:, :, cols] += gk
                dkv[1][:, :, cols] += gv
            if j < c - 1 and not ctx.overlap:
                nxt, works = exchange(axis, kv)
            wait(works)
            # the accumulator follows its block: one move per step, and the last brings it home
            moved, w2 = exchange(axis, dkv)
            wait(w2)
            dkv = moved
            if j < c - 1:
                kv = nxt
        return dq.to(q_BHQE.dtype), dkv[0].to(k_BKNE.dtype), dkv[1].to(v_BKNE.dtype), *[None] * 5
