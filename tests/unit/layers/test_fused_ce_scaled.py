"""The fused head + CE (layers/fused_ce.py) told the loss's upstream grad in forward (the executor's 1 /
tokens per step): its grads come out scaled and dW is summed straight into the weight's fp32 main_grad, equal
to the unscaled path's; a caller whose upstream grad differs gets a NaN in its grads (the step is skipped,
not silently wrong). Its chunks are equal where the token count allows, so the compiled chain has one
static shape."""

import torch
from torch._dynamo.utils import counters

from megaframe.layers import fused_ce, wgrad


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 32, generator=g).requires_grad_()
    w = (torch.randn(256, 32, generator=g) * 0.2).requires_grad_()
    t = torch.randint(0, 256, (64, 1), generator=g)
    return x, w, t


def _into_main(w: torch.Tensor) -> torch.Tensor:
    w.fuse_wgrad, w.main_grad = True, torch.full(w.shape, float("nan"))
    wgrad.forget([w.main_grad])
    return w.main_grad


def test_grads_scaled_in_forward_equal_the_backward_scaled_ones(monkeypatch):
    monkeypatch.setitem(fused_ce.CHUNK_ELEMS, "cpu", 16 * 256)  # 4 chunks
    x, w, t = _inputs()
    (fused_ce.linear_cross_entropy(x, w, t).sum() / 64).backward()
    x2, w2, _ = _inputs()
    main = _into_main(w2)
    for _ in range(2):  # two micro-batches: written, then accumulated
        (fused_ce.linear_cross_entropy(x2, w2, t, scale=1 / 64).sum() / 64).backward()
        assert wgrad.take_fused(main)  # the param's hook drops the dummy grad
    torch.testing.assert_close(main, 2 * w.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x2.grad, 2 * x.grad, rtol=1e-5, atol=1e-7)
    wgrad.forget([main])


def test_an_upstream_grad_other_than_the_promised_one_poisons_the_grads():
    """The NaN goes into grad x, this micro-batch's own, which carries it into every grad before the head
    (main_grad is shared with the head's next forward, which an overlapped kind runs at the same time); into
    main_grad where x takes no grad. Kept, the promise leaves both untouched."""
    x, w, t = _inputs()
    main = _into_main(w)
    fused_ce.linear_cross_entropy(x, w, t, scale=1 / 64).sum().backward()  # upstream grad 1, not 1/64
    assert torch.isnan(x.grad).any() and not torch.isnan(main).any()
    wgrad.forget([main])
    x, w, t = _inputs()
    main = _into_main(w)
    fused_ce.linear_cross_entropy(x.detach(), w, t, scale=1 / 64).sum().backward()
    assert torch.isnan(main).any()
    wgrad.forget([main])
    x, w, t = _inputs()
    main = _into_main(w)
    (fused_ce.linear_cross_entropy(x, w, t, scale=1 / 64).sum() / 64).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(main).all()
    wgrad.forget([main])


def test_chunks_are_equal_so_the_compiled_chain_has_one_static_shape(monkeypatch):
    # 16,384 tokens at a 128k vocab: was 8,372 + 8,012 (a second shape: a dynamic recompile)
    n, v = 16384, 128256
    c = fused_ce._chunk_tokens(n, v, torch.device("cuda"))
    assert n % c == 0 and c * v <= fused_ce.CHUNK_ELEMS["cuda"], c
    # the same plan at CPU size: 96 tokens in a budget of 40 per chunk: 3 x 32 (was 40 + 40 + 16)
    m, vocab = 96, 40
    monkeypatch.setitem(fused_ce.CHUNK_ELEMS, "cpu", 40 * vocab)
    c = fused_ce._chunk_tokens(m, vocab, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    chain = torch.compile(fused_ce._ce_math, dynamic=False, backend="eager")
    sizes = []
    for lo in range(0, m, c):
        logits = torch.randn(min(c, m - lo), vocab)
        chain(logits, torch.randint(0, vocab, (logits.shape[0],)), 0.5)
        sizes.append(logits.shape[0])
    assert sizes == [32, 32, 32], sizes
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
