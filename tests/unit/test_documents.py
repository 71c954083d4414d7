"""data.document_mask: a masked sample gives, for each of its documents, the logits of that document run
alone through the model (positions from 0, nothing seen of the others); RoPE and learned positions."""
from __future__ import annotations

import pytest
import torch

from megaframe.config import load_config
from megaframe.model.documents import FLEX_BLOCK, document_context
from megaframe.model.gpt import build_model
from megaframe.parallel.mesh import single_process_mesh

EOS = [0, 64, 128, 192]  # the synthetic data's end-of-document ids (multiples of 64) at vocab 256


def doc_ids(lengths: list[int], seq: int, seed: int = 0) -> torch.Tensor:
    """One sample of documents of these lengths (each ends with an end id, the last runs to the edge)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (seq,), generator=g)  # 1..63: never an end id
    for end in torch.tensor(lengths).cumsum(0)[:-1].tolist():
        ids[end - 1] = 64
    return ids


@pytest.mark.parametrize("family", [[], ["model=gpt2_tiny", "model.num_query_groups=null"]], ids=["rope", "learned"])
def test_each_document_gets_the_logits_it_would_get_alone(family):
    cfg = load_config(["data=synthetic", *family, "model.vocab_size=256", "model.seq_length=32",
                       "data.document_mask=true"], world_size=1)
    model = build_model(cfg, single_process_mesh()).eval()
    lengths = [10, 6, 16]  # boundaries at 10 and 16 = S/2 (a tp2·sp chunk edge)
    ids = torch.stack([doc_ids(lengths, 32, 0), doc_ids([16, 16], 32, 1)])
    model.set_documents(EOS)
    with torch.no_grad():
        masked = model(ids)
        model.doc_eos = None
        for b, lens in enumerate([lengths, [16, 16]]):
            start = 0
            for n in lens:
                alone = model(ids[b:b + 1, start:start + n])[0]
                torch.testing.assert_close(masked[b, start:start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
        plain = model(ids)
    assert not torch.allclose(masked, plain, atol=1e-3)  # the mask changed what later documents saw


def test_document_context_positions_and_mask():
    ids = torch.tensor([[5, 64, 7, 8, 0, 9]])
    doc = document_context(ids, torch.tensor(EOS))
    assert doc.pos_BQ.tolist() == [[0, 1, 0, 1, 2, 0]]
    allowed = doc.mask_B1QT[0, 0].int().tolist()
    assert allowed[3] == [0, 0, 1, 1, 0, 0] and allowed[5] == [0, 0, 0, 0, 0, 1] and allowed[1] == [1, 1, 0, 0, 0, 0]


def test_document_mask_is_accepted_with_context_parallelism():
    for comm_kind in ("allgather", "ring"):  # was refused before cp supported it (model/documents.py)
        load_config(["data=synthetic", "data.document_mask=true", "parallel.cp=2", f"parallel.cp_comm={comm_kind}"],
                    world_size=2)


def test_flex_block_mask_skips_the_blocks_no_query_sees():
    """The FlexAttention block mask (CUDA's kernel) marks exactly the [128, 128] tiles holding a visible
    pair: the future and other documents' tiles are skipped, the rest computed (full or partial)."""
    s = 4 * FLEX_BLOCK
    ids = torch.stack([doc_ids([133, 200, 179], s, 0), doc_ids([s], s, 1)])
    doc = document_context(ids, torch.tensor(EOS), kernel="sdpa")
    flex = document_context(ids, torch.tensor(EOS), kernel="flex")
    assert flex.mask_B1QT is None
    tiles_BQK = doc.mask_B1QT[:, 0].unflatten(1, (4, FLEX_BLOCK)).unflatten(3, (4, FLEX_BLOCK)).any(4).any(2)
    assert torch.equal(flex.block_mask.to_dense()[:, 0].bool(), tiles_BQK)
    # sample 0: the last document starts in tile 2 (token 333): tile 3 skips tiles 0 and 1
    assert tiles_BQK[0, 3].tolist() == [False, False, True, True]
    assert tiles_BQK[1].tril().equal(tiles_BQK[1]) and tiles_BQK[1].diagonal().all()


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_attention_forward_matches_the_sdpa_mask_on_cpu():
    """torch 2.13 runs FlexAttention's forward on CPU (eager; its backward is CUDA-only): the model's
    logits under the block mask equal the SDPA mask path's (the CPU reference), 1e-5."""
    cfg = load_config(["data=synthetic", "model.vocab_size=256", "model.seq_length=256",
                       "data.document_mask=true"], world_size=1)
    model = build_model(cfg, single_process_mesh()).eval()
    model.set_documents(EOS)
    ids = torch.stack([doc_ids([100, 28, 128], 256, 0), doc_ids([3, 253], 256, 1)])  # one ends at a tile edge
    out = {}
    with torch.no_grad():
        for kernel in ("sdpa", "flex"):
            model.doc_kernel = kernel
            out[kernel] = model(ids)
    torch.testing.assert_close(out["flex"], out["sdpa"], rtol=1e-5, atol=1e-5)
