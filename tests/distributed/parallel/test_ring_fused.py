"""Ring attention on fused flash kernels (parallel/ring_fused.py) against the fp32 math ring it replaces
where the device has the kernels: outputs and the grads of q, k, v, on real gloo cp groups."""

import pytest
import torch

pytestmark = pytest.mark.distributed


def fused_vs_math(m, cp: int, dtype: str) -> float | None:
    """Max relative difference over out, dq, dk, dv (each rank's, max over ranks); rank 0 returns it."""
    import torch.distributed as dist

    from megaframe.parallel.ring_attention import ring_attention

    b, h, k, s, e = 2, 4, 2, 16 * cp, 8  # GQA 2:1; each rank: two chunks of 8 tokens
    g = torch.Generator().manual_seed(m.cp.rank)
    dt = getattr(torch, dtype)
    q = torch.randn(b, h, s // cp, e, generator=g).to(dt)
    kk, vv = (torch.randn(b, k, s // cp, e, generator=g).to(dt) for _ in range(2))
    go = torch.randn(b, h, s // cp, e, generator=g).to(dt)
    outs = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, kk, vv)]
        out = ring_attention(*leaves, m.cp, s, fused=fused, tile_elems=64)
        out.backward(go)
        outs.append([out.detach().float()] + [t.grad.float() for t in leaves])
    worst = torch.tensor([max(((a - r).norm() / r.norm()).item() for a, r in zip(*outs))])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=m.cp.group)
    return worst.item() if m.rank == 0 else None


@pytest.mark.parametrize("cp", [2, 4])
def test_fused_ring_equals_the_math_ring_fp32(pool, cp):
    worst = pool.run(fused_vs_math, cp, cp, "float32", cp=cp)[0]
    assert worst <= 1e-5, worst


def test_fused_ring_bf16_is_close_to_the_fp32_math(pool):
    """bf16: flash kernels on bf16 operands against the fp32 math on the same bf16 values."""
    worst = pool.run(fused_vs_math, 2, 2, "bfloat16", cp=2)[0]
    assert worst <= 2e-2, worst
