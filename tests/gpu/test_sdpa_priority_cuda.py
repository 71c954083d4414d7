"""The model's causal SDPA on CUDA prefers cuDNN (attention.SDPA_PRIORITY): its outputs and grads match
FlashAttention-2's at the llama_1b head dim, bf16, GQA, and the global backend order is left as it was."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megaframe.model.attention import causal_sdpa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.float().square().sum().backward()
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cudnn_first_sdpa_matches_flash_forward_and_backward(head_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, h, 1024, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (16, 4, 4)
    )
    before = torch._C._get_sdp_priority_order()

    def flash(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    got = _run(lambda q, k, v: causal_sdpa(q, k, v, 0.0, True), q, k, v)
    ref = _run(flash, q, k, v)
    assert torch._C._get_sdp_priority_order() == before
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
