"""GPU checks (skipped without CUDA; scripts/gpu_check.py runs them): the mm/addmm out_dtype probe, the
fused ring's CUDA flash pair, and the pinned staging buffer."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_gpu_launch_and_kernels import fused_ring_vs_sdpa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_mixed_gemm_probe_finds_the_overloads_on_a_recent_torch():
    """torch 2.11 (the H100 image's) has both overloads with an fp32 `self` (pytorch#167931); before 2.8
    neither exists. Between, the probe answers whatever that build does, and the fallback covers it."""
    from megaframe.layers.fused_ce import mixed_gemm

    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 11):
        assert mixed_gemm("cuda")
    elif version < (2, 8):
        assert not mixed_gemm("cuda")


def test_fused_ring_flash_pair_matches_sdpa_on_cuda():
    """One rank's ring (c = 1: both chunks, three chunk pairs) on CUDA flash, bf16, GQA, head dim 128,
    against SDPA causal on the same sequence: output and q, k, v grads."""
    assert fused_ring_vs_sdpa("cuda", torch.bfloat16, b=1, h=8, k=2, s=1024, e=128) <= 2e-2


def test_pinned_staging_registers_and_copies():
    from megaframe.checkpoint.staging import PinnedStaging

    ts = [torch.randn(1000, 3, device="cuda"), torch.randn(77, device="cuda").bfloat16()]
    staging = PinnedStaging()
    views = staging.views(ts)
    for v, t in zip(views, ts):
        v.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert staging.registered and views[0].is_pinned()
    assert all(torch.equal(v, t.cpu()) for v, t in zip(views, ts))
    staging.release()
