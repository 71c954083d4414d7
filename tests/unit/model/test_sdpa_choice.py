"""The causal SDPA's CUDA backend order by compute capability (model/attention.py: sdpa_priority): cuDNN
first only on Hopper, where it is faster than flash and correct; flash first and no cuDNN elsewhere (slower
on A100 and Blackwell RTX, wrong outputs with fewer than 8 KV heads on B200 under torch 2.13). Before, cuDNN
was put first on every CUDA device."""

import pytest
from torch.nn.attention import SDPBackend

from megaframe.model.attention import sdpa_priority


def test_cudnn_first_on_hopper():
    assert sdpa_priority((9, 0))[0] is SDPBackend.CUDNN_ATTENTION


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)], ids=str)
def test_flash_first_and_no_cudnn_elsewhere(capability):
    order = sdpa_priority(capability)
    assert order[0] is SDPBackend.FLASH_ATTENTION and SDPBackend.CUDNN_ATTENTION not in order, order
