"""Float8 casts per tensor per micro-batch (train.precision=fp8), counted op by op on CPU: each cast is
several memory-bound passes over its tensor (abs, max, scale, clamp, convert: ~33 B per element eager), so a
second cast of the same tensor with the same scaling is pure cost.

Under the tensorwise recipe a block linear casts its input, its weight and its output's grad once each per
micro-batch (torchao's matmul casts each twice: the weight again in backward, x and the grad again for the
weight-grad GEMM), and its weight grad is accumulated into the fp32 main_grad like a bf16 linear's. The fused
head + CE's chunk casts x, the weight and the logits' grad once each (twice before)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaframe.layers import fused_ce, wgrad
from megaframe.layers.fp8 import Fp8Gemm

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class Float8Casts(TorchDispatchMode):
    """Counts the ops that make a float8 tensor, by the shape of the tensor cast."""

    def __init__(self):
        super().__init__()
        self.by_shape: dict[tuple, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "to") and isinstance(out, torch.Tensor) and out.dtype in F8:
            shape = tuple(args[0].shape)
            self.by_shape[shape] = self.by_shape.get(shape, 0) + 1
        return out


def _linear(recipe: str, main: torch.Tensor | None):
    g = torch.Generator().manual_seed(0)
    n, i, o = 32, 48, 64  # every dim distinct: a cast's shape names its operand
    x = torch.randn(n, i, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(o, i, generator=g) * 0.2).bfloat16().requires_grad_()
    if main is not None:
        w.fuse_wgrad, w.main_grad = True, main
    gy = torch.randn(n, o, generator=g).bfloat16()
    with Float8Casts() as seen:
        Fp8Gemm(recipe)(x, w).backward(gy)
    casts = {"x": seen.by_shape.get((n, i), 0), "w": seen.by_shape.get((i, o), 0)}
    casts["grad_y"] = seen.by_shape.get((n, o), 0)
    return casts, x, w, gy


@pytest.mark.parametrize("recipe,want", [("tensorwise", (1, 1, 1)), ("rowwise", (1, 2, 1))])
def test_block_linear_casts_each_operand_once_per_micro_batch(recipe, want):
    casts, *_ = _linear(recipe, None)
    # before: 2, 2, 2 (torchao's matmul: x and the grad again for the weight grad, the weight in backward)
    assert (casts["x"], casts["w"], casts["grad_y"]) == want, casts


def test_block_linear_weight_grad_goes_into_the_fp32_main_grad_over_micro_batches():
    main = torch.full((64, 48), float("nan"))  # the step's first write overwrites (zero_grad zeroes nothing)
    wgrad.forget([main])
    before = wgrad.calls
    want = torch.zeros(64, 48)
    for _ in range(2):
        _, x, w, gy = _linear("tensorwise", main)
        want += gy.float().t() @ x.detach().float()
        assert wgrad.take_fused(main)  # the param's hook would drop the dummy grad
    assert wgrad.calls - before == 2
    torch.testing.assert_close(main, want, rtol=1e-5, atol=1e-5)
    wgrad.forget([main])


def test_fused_head_casts_each_operand_once_per_chunk(monkeypatch):
    monkeypatch.setitem(fused_ce.CHUNK_ELEMS, "cpu", 16 * 256)  # 64 tokens in chunks of 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(256, 32, generator=g) * 0.2).bfloat16().requires_grad_()
    t = torch.randint(0, 256, (64, 1), generator=g)
    with Float8Casts() as seen:
        fused_ce.linear_cross_entropy(x, w, t, Fp8Gemm("tensorwise", pad_inner_dim=True)).sum().backward()
    chunks = 4
    # before: the weight twice per micro-batch, each chunk's x and logits' grad twice
    assert seen.by_shape.get((32, 256)) == 1, seen.by_shape
    assert seen.by_shape.get((16, 32)) == chunks and seen.by_shape.get((16, 256)) == chunks, seen.by_shape
