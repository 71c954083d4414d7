"""The cp all-gather path's per-chunk attention (parallel/cp_attention.py) against one masked SDPA call
under context.cp_causal_bias: the same values and grads for every cp rank of c = 1..4 with GQA, and no
[S/c, S] tensor saved for backward."""

import pytest
import torch
import torch.nn.functional as F

from megaframe.parallel.context import cp_causal_bias
from megaframe.parallel.cp_attention import cp_chunked_attention, cp_global_order

B, H, K, E = 2, 4, 2, 8  # GQA: two query heads per kv head


def gathered(seq: int, cp: int, dtype=torch.float32):
    """q_BHQE of every rank and the group's K/V in cp-rank order (as comm.gather_from_cp leaves them)."""
    g = torch.Generator().manual_seed(seq * 10 + cp)
    k_BKTE, v_BKTE = (torch.randn(B, K, seq, E, generator=g, dtype=dtype) for _ in range(2))
    qs = [torch.randn(B, H, seq // cp, E, generator=g, dtype=dtype) for _ in range(cp)]
    return qs, k_BKTE, v_BKTE


def grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunked_attention_equals_masked_sdpa(cp, dtype, tol):
    seq = 24 * cp  # chunks of 12 tokens
    qs, k, v = gathered(seq, cp, dtype)
    for rank, q in enumerate(qs):
        bias_QT = cp_causal_bias(seq, cp, rank, torch.device("cpu"), dtype)
        do = torch.randn_like(q)
        ref = grads(
            lambda q, k, v, b=bias_QT: F.scaled_dot_product_attention(q, k, v, attn_mask=b, enable_gqa=True),
            q,
            k,
            v,
            do,
        )
        got = grads(lambda q, k, v, r=rank: cp_chunked_attention(q, k, v, seq, cp, r), q, k, v, do)
        for name, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert (a - b).abs().max() <= tol * max(1.0, b.abs().max()), (cp, rank, name, (a - b).abs().max())


def test_global_order_inverts_the_gather():
    cp, n = 3, 2
    pos = torch.arange(2 * cp * n)
    rank_order = torch.cat(
        [
            torch.cat([pos[r * n : (r + 1) * n], pos[(2 * cp - 1 - r) * n : (2 * cp - r) * n]])
            for r in range(cp)
        ]
    )
    assert torch.equal(cp_global_order(rank_order.view(1, 1, -1, 1), cp).flatten(), pos)


def saved_shapes(fn) -> list[torch.Size]:
    shapes = []

    def pack(t):
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_query_by_key_tensor_is_saved():
    """What backward keeps is q, K/V, the output and the [B, H, Q] log-sum-exp: no [Q, T] mask or score
    tensor. The same probe on the masked call finds the [S/c, S] bias (it bites)."""
    seq, cp, rank = 96, 2, 1
    qs, k, v = gathered(seq, cp)
    q, k, v = (t.requires_grad_() for t in (qs[rank], k, v))
    q_len = seq // cp

    def has_qt(shapes):
        return any(len(s) >= 2 and s[-2] == q_len and s[-1] == seq for s in shapes)

    shapes = saved_shapes(lambda: cp_chunked_attention(q, k, v, seq, cp, rank))
    assert not has_qt(shapes), shapes
    assert max(s.numel() for s in shapes) == max(q.numel(), k.numel()), shapes
    bias_QT = cp_causal_bias(seq, cp, rank, torch.device("cpu"), torch.float32)
    masked = saved_shapes(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias_QT, enable_gqa=True))
    assert has_qt(masked), masked


def test_runs_on_meta_for_the_planner():
    seq, cp = 64, 2
    q = torch.empty(B, H, seq // cp, E, device="meta", requires_grad=True)
    k, v = (torch.empty(B, K, seq, E, device="meta", requires_grad=True) for _ in range(2))
    assert cp_chunked_attention(q, k, v, seq, cp, 1).shape == q.shape


@pytest.mark.parametrize("cp", [1, 3])
def test_lower_right_calls_equal_masked_sdpa(cp):
    """The per-chunk causal_lower_right calls other devices run (CPU materialises the mask: exact here)."""
    from megaframe.parallel.cp_attention import cp_query_segments, lower_right_sdpa

    seq = 24 * cp
    qs, k, v = gathered(seq, cp)
    for rank, q in enumerate(qs):
        bias_QT = cp_causal_bias(seq, cp, rank, torch.device("cpu"), torch.float32)
        do = torch.randn_like(q)
        ref = grads(
            lambda q, k, v, b=bias_QT: F.scaled_dot_product_attention(q, k, v, attn_mask=b, enable_gqa=True),
            q,
            k,
            v,
            do,
        )
        segs = cp_query_segments(seq, cp, rank)
        got = grads(
            lambda q, k, v, sg=segs: lower_right_sdpa(q, cp_global_order(k, cp), cp_global_order(v, cp), sg),
            q,
            k,
            v,
            do,
        )
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= 2e-6 * max(1.0, b.abs().max())
