"""data.document_mask: a masked sample gives, for each of its documents, the logits of that document run
alone through the model (positions from 0, nothing seen of the others); RoPE and learned positions. The
FlexAttention block mask (CUDA's kernel) against the SDPA mask on CPU, what the planner counts, and the
fused ring's merge of a block a query cannot see."""

from __future__ import annotations

import pytest
import torch

from megaframe.config import load_config
from megaframe.model.documents import FLEX_BLOCK, document_context
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build_model

EOS = [0, 64, 128, 192]  # the synthetic data's end-of-document ids (multiples of 64) at vocab 256


def doc_ids(lengths: list[int], seq: int, seed: int = 0) -> torch.Tensor:
    """One sample of documents of these lengths (each ends with an end id, the last runs to the edge)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (seq,), generator=g)  # 1..63: never an end id
    for end in torch.tensor(lengths).cumsum(0)[:-1].tolist():
        ids[end - 1] = 64
    return ids


@pytest.mark.parametrize(
    "family", [[], ["model=gpt2_tiny", "model.num_query_groups=null"]], ids=["rope", "learned"]
)
def test_each_document_gets_the_logits_it_would_get_alone(family):
    cfg = load_config(
        ["data=synthetic", *family, "model.vocab_size=256", "model.seq_length=32", "data.document_mask=true"],
        world_size=1,
    )
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
                alone = model(ids[b : b + 1, start : start + n])[0]
                torch.testing.assert_close(masked[b, start : start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
        plain = model(ids)
    assert not torch.allclose(masked, plain, atol=1e-3)  # the mask changed what later documents saw


def test_document_context_positions_and_mask():
    ids = torch.tensor([[5, 64, 7, 8, 0, 9]])
    doc = document_context(ids, torch.tensor(EOS))
    assert doc.pos_BQ.tolist() == [[0, 1, 0, 1, 2, 0]]
    allowed = doc.mask_B1QT[0, 0].int().tolist()
    assert (
        allowed[3] == [0, 0, 1, 1, 0, 0]
        and allowed[5] == [0, 0, 0, 0, 0, 1]
        and allowed[1] == [1, 1, 0, 0, 0, 0]
    )


def test_document_mask_is_accepted_with_context_parallelism():
    for comm_kind in ("allgather", "ring"):  # was refused before cp supported it (model/documents.py)
        load_config(
            ["data=synthetic", "data.document_mask=true", "parallel.cp=2", f"parallel.cp_comm={comm_kind}"],
            world_size=2,
        )


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
    cfg = load_config(
        [
            "data=synthetic",
            "model.vocab_size=256",
            "model.seq_length=256",
            "model.num_layers=2",
            "data.document_mask=true",
        ],
        world_size=1,
    )
    model = build_model(cfg, single_process_mesh()).eval()
    model.set_documents(EOS)
    ids = torch.stack([doc_ids([100, 28, 128], 256, 0), doc_ids([3, 253], 256, 1)])  # one ends at a tile edge
    out = {}
    with torch.no_grad():
        for kernel in ("sdpa", "flex"):
            model.doc_kernel = kernel
            out[kernel] = model(ids)
    torch.testing.assert_close(out["flex"], out["sdpa"], rtol=1e-5, atol=1e-5)


def _planned_activations(over: list[str]) -> int:
    from megaframe.planning.memory.rank_plan import plan_layout

    cfg = load_config(PLAN + over, world_size=1, check_data=False)
    return plan_layout(cfg, 1).ranks[0].chunk_activation_bytes[0]


PLAN = [
    "data=synthetic",
    "model.vocab_size=256",
    "model.seq_length=256",
    "model.num_layers=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


def test_planner_counts_the_document_mask_as_measured():
    """What document masking adds to one micro-batch's activations: on CPU (SDPA under the boolean mask)
    the planner's meta forward gives the bytes a real CPU forward saves, to the byte: the float copy of
    the [B, 1, S, S] mask SDPA saves per layer, and the per-token RoPE rows. On an accelerator
    (FlexAttention) the block mask's int32 tiles instead of the per-layer copies, counted."""
    from megaframe.model.documents import block_mask_bytes
    from megaframe.planning.memory.activations import chunk_activation_bytes

    b, s, layers, e = 2, 256, 2, 16  # gpt_tiny's head dim 16
    plain, cpu = (
        _planned_activations(["train.device=cpu"]),
        _planned_activations(["train.device=cpu", "data.document_mask=true"]),
    )
    measured = {}
    for mask in ("false", "true"):
        model = build_model(
            load_config(PLAN + [f"data.document_mask={mask}"], world_size=1, check_data=False),
            single_process_mesh(),
        )
        if mask == "true":
            model.set_documents(EOS)
        measured[mask] = chunk_activation_bytes(model, 0, b, fused_attention=False)  # the real CPU kernels
    rope_rows = 2 * s * b * e * 4  # cos and sin gathered at each token's position, fp32 [S, B, 1, E]
    assert cpu - plain == measured["true"] - measured["false"] == layers * b * s * s * 4 + rope_rows
    # against the accelerator's own plan without documents (its fused RMSNorm keeps less than the CPU's)
    flex = _planned_activations(["train.device=cuda", "data.document_mask=true"])
    flex_plain = _planned_activations(["train.device=cuda"])
    ids_and_positions = (s + s + b * s) * 8  # the mask function's query / key positions and document ids
    assert flex - flex_plain == rope_rows + block_mask_bytes(b, s, s) + ids_and_positions


def test_block_mask_bytes_count_a_real_block_mask():
    from megaframe.model.documents import block_mask_bytes

    for s, lengths in ((256, [100, 156]), (300, [300])):  # 300: partial tiles round up
        ids = torch.stack([doc_ids(lengths, s, 0)] * 3)
        bm = document_context(ids, torch.tensor(EOS), kernel="flex").block_mask
        real = sum(t.nbytes for t in vars(bm).values() if isinstance(t, torch.Tensor))
        assert real == block_mask_bytes(3, s, s)


def test_layout_search_counts_the_document_mask_like_the_exact_planner():
    """The search's per-layer figures (memory/dims.py) include the documents' mask as the exact planner
    does (train.device=cpu: SDPA's per-layer float copy of the [S, S] mask, 22 % of the peak here; the
    accelerator's block mask is too small to tell apart at this size)."""
    from megaframe.planning.candidate import Layout, layout_config
    from megaframe.planning.memory.dims import phase_memory
    from megaframe.planning.memory.rank_plan import plan_layout
    from tests.unit.planning.test_plan_search import SMALL

    small = [o for o in SMALL if not o.startswith("model.seq_length")]  # S = 512: the S x S mask matters
    cfg = load_config(
        small + ["model.seq_length=512", "data.document_mask=true", "train.device=cpu"],
        world_size=1,
        check_data=False,
    )
    for lay in (Layout(1, 1, 1, 2, 1, 1, 1, "none", cp=2), Layout(2, 1, 1, 1, 1, 0, 2, "full", cp=2)):
        worst = max(plan_layout(layout_config(cfg, lay), 4, None).ranks, key=lambda r: r.peak_bytes)
        got = phase_memory(cfg, lay)
        for k, want in worst.phases.items():
            assert abs(got[k] - want) / want < 0.05, (k, got, worst.phases)


def test_a_block_a_query_cannot_see_merges_without_nan():
    """The fused ring's pieces under document masking: a query row that sees no key of a chunk pair gets
    lse -inf (the CPU kernel reports 0 for it), and merging it, before or after any visible block, leaves
    the row's output and lse as if the pair were absent, never NaN."""
    from megaframe.parallel.ring_fused import _merge_, pair_bias, pair_forward

    q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    docq, dock = torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 0, 0, 0]])  # rows 2, 3: a later document
    out, lse, _ = pair_forward(q, k, v, False, 8**-0.5, pair_bias(docq, dock, False, q.dtype))
    assert lse[0, :, 2:].isneginf().all() and lse[0, :, :2].isfinite().all()
    o, acc = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), float("-inf"))
    _merge_(o, acc, out, lse)  # rows 2, 3: -inf merged into -inf
    assert not o.isnan().any() and acc[0, :, 2:].isneginf().all()
    own_out, own_lse, _ = pair_forward(q, k, v, True, 8**-0.5)  # each row's own (diagonal) block
    _merge_(o, acc, own_out, own_lse)
    assert torch.equal(acc[0, :, 2:], own_lse[0, :, 2:]) and torch.allclose(o[0, :, 2:], own_out[0, :, 2:])
