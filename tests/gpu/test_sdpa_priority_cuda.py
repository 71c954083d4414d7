"""The model's causal SDPA on CUDA takes the backend order of the device's capability
(attention.sdpa_priority): on Hopper cuDNN is the kernel torch chooses for the model's q/k/v (asserted, not
only compared), elsewhere flash; its outputs and grads match FlashAttention-2's at the llama_1b head dim,
bf16, GQA, and the global backend order is left as it was."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megaframe.model.attention import causal_sdpa, sdpa_priority

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


def test_the_backend_chosen_for_the_model_layout_is_the_capabilitys_first():
    """The model's q/k/v views (a permuted S,B,H,E projection, GQA 16/4 heads, head dim 64) under the
    capability's order: torch's own choice (_fused_sdp_choice) is its first backend (cuDNN on H100)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, b, e = 1024, 2, 64
    q, k, v = (
        torch.randn(s, b, h, e, device="cuda", dtype=torch.bfloat16, generator=gen).permute(1, 2, 0, 3)
        for h in (16, 4, 4)
    )
    cap = torch.cuda.get_device_capability()
    order = sdpa_priority(cap)
    with sdpa_kernel(order, set_priority=True):
        chosen = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
    assert SDPBackend(chosen) == order[0], (cap, SDPBackend(chosen), order)
