"""Document masking on CUDA (skipped without CUDA; scripts/gpu_check.py runs tests/gpu): the model picks
FlexAttention under a block mask (model/documents.py) and its forward and backward equal the SDPA
boolean-mask path (the CPU reference) on the same weights and documents. CPU runs flex's forward only
(tests/unit/model/test_documents.py compares it there); its backward exists on CUDA alone."""

from __future__ import annotations

import pytest
import torch

from megaframe.config import load_config
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build_model
from tests.unit.model.test_documents import EOS, doc_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(model, ids, labels, kernel):
    model.doc_kernel = kernel
    model.zero_grad(set_to_none=True)
    loss_BS = model(ids, labels)
    loss_BS.sum().backward()
    return loss_BS.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_flex_block_mask_training_matches_the_sdpa_mask_on_cuda():
    cfg = load_config(
        ["data=synthetic", "model.vocab_size=256", "model.seq_length=512", "data.document_mask=true"],
        world_size=1,
    )
    model = build_model(cfg, single_process_mesh("cuda")).train()
    model.set_documents(EOS)
    assert model._doc_kernel() == "flex"
    ids = torch.stack([doc_ids([100, 156, 128, 128], 513, 0), doc_ids([7, 506], 513, 1)]).cuda()
    x, y = ids[:, :-1], ids[:, 1:]
    torch.backends.cuda.matmul.allow_tf32 = False
    loss_ref, grads_ref = _run(model, x, y, "sdpa")
    loss, grads = _run(model, x, y, None)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-5)
    for n, g in grads_ref.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-3, atol=1e-5, msg=n)
