"""data.document_mask under tp·sp, pp, dp, cp (both cp_comm) and recompute: the one-process losses (1e-5),
grads and weights. Synthetic data ends documents at ids that are multiples of 64: at seq 32 about 40 % of the
samples hold a boundary, anywhere in the sequence (at tp/sp chunk edges too;
tests/unit/model/test_documents.py pins one at S/2); the cp cases add an end id that starts a document exactly
at a cp chunk edge."""

import pytest
import torch

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config, train_and_report

pytestmark = pytest.mark.distributed

# three steps: step 1's loss and grads under the mask, two updates, the weights after three
STEPS = 3
MASK = ["data.document_mask=true"]
_ref: dict = {}

LAYOUTS = [  # (name, ranks, tp, pp, overrides)
    ("tp2-sp", 2, 2, 1, ["parallel.tp=2", "parallel.sp=true"]),
    ("tp2-dp2-sp-selective", 4, 2, 1, ["parallel.tp=2", "parallel.sp=true", "train.recompute=selective"]),
    ("pp2-full", 2, 1, 2, ["parallel.pp=2", "train.recompute=full"]),
    ("tp2-sp-op_selective", 2, 2, 1, ["parallel.tp=2", "parallel.sp=true", "train.recompute=op_selective"]),
    (
        "learned-tp2-sp-pp2",
        4,
        2,
        2,
        [
            "model=gpt2_tiny",
            "model.num_query_groups=null",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.pp=2",
        ],
    ),
]


@pytest.mark.parametrize("name,n,tp,pp,over", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_document_mask_layout_matches_one_process(pool, name, n, tp, pp, over):
    family = [o for o in over if o.startswith("model")]
    key = tuple(family)
    if key not in _ref:
        _ref[key] = pool.run(train_and_report, 1, MASK + family, STEPS)[0]
        plain = pool.run(train_and_report, 1, family, STEPS)[0]
        assert _ref[key]["losses"] != plain["losses"]  # the mask is not a no-op on this data
    ref = _ref[key]
    got = pool.run(train_and_report, n, MASK + over, STEPS, tp=tp, pp=pp)[0]
    _assert_matches(got, ref)


def _assert_matches(got: dict, ref: dict) -> None:
    """Losses to 1e-5 relative, grads and updated weights to float32 noise."""
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    for k in ref["grads"]:
        torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=1e-4, atol=1e-6)
    for k in ref["weights"]:
        torch.testing.assert_close(got["weights"][k], ref["weights"][k], rtol=1e-4, atol=1e-4)


def _edge_setup(model, extra_eos: list[int], fused: bool = True) -> None:
    """Ends documents also at `extra_eos` (ids the test picked so that a document starts exactly at a cp
    chunk edge); fused=False runs the fp32 math ring instead of the fused one (the CUDA ring's path)."""
    set_documents = model.set_documents
    model.set_documents = lambda ids: set_documents(list(ids) + extra_eos)
    for m in model.modules():
        if hasattr(m, "ring_fused"):
            m.ring_fused = fused


def edge_eos() -> list[int]:
    """The id the first sample holds at index 7: as an end id it makes index 8 a document's first token,
    the edge between cp chunks at cp2 (chunks of 8 at S = 32) and cp4 (chunks of 4)."""
    from tests.forms import build_data, microbatches

    cfg = tiny_config(MASK, 1)
    x_BS = microbatches(build_data(cfg), 0, 8, 2, 0, 1, cfg.train.seed)[0][0]
    assert (
        int(x_BS[0, 7]) % 64 != 0 and int(x_BS[0, 8]) % 64 != 0
    )  # not already an end; 8 does not end at once
    return [int(x_BS[0, 7])]


CP_LAYOUTS = [  # (name, ranks, tp, cp, pp, overrides, fused ring)
    ("cp2-allgather", 2, 1, 2, 1, ["parallel.cp=2"], True),
    (
        "cp2-ring-selective",
        2,
        1,
        2,
        1,
        ["parallel.cp=2", "parallel.cp_comm=ring", "train.recompute=selective"],
        True,
    ),
    ("cp4-ring-math", 4, 1, 4, 1, ["parallel.cp=4", "parallel.cp_comm=ring"], False),
    (
        "cp2-ring-pp2-full",
        4,
        1,
        2,
        2,
        ["parallel.cp=2", "parallel.cp_comm=ring", "parallel.pp=2", "train.recompute=full"],
        True,
    ),
    (
        "learned-cp2-tp2-sp",
        4,
        2,
        2,
        1,
        [
            "model=gpt2_tiny",
            "model.num_query_groups=null",
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sp=true",
        ],
        True,
    ),
]


@pytest.mark.parametrize("name,n,tp,cp,pp,over,fused", CP_LAYOUTS, ids=[x[0] for x in CP_LAYOUTS])
def test_document_mask_under_cp_matches_one_process(pool, name, n, tp, cp, pp, over, fused):
    """Context parallelism, both cp_comm kinds and the load-balanced chunk order: a document starting
    exactly at a cp chunk edge (edge_eos), documents running across chunks of other cp ranks (positions
    from the whole sample's end tokens), query rows that see no key of a whole K/V block."""
    from functools import partial

    family = [o for o in over if o.startswith("model")]
    key = ("edge", *family)
    if key not in _ref:
        _ref["eos"] = _ref.get("eos") or edge_eos()
        _ref[key] = pool.run(
            train_and_report, 1, MASK + family, STEPS, partial(_edge_setup, extra_eos=_ref["eos"])
        )[0]
    got = pool.run(
        train_and_report,
        n,
        MASK + over,
        STEPS,
        partial(_edge_setup, extra_eos=_ref["eos"], fused=fused),
        tp=tp,
        pp=pp,
        cp=cp,
    )[0]
    ref = _ref[key]
    _assert_matches(got, ref)
    # comm_bytes/cp: the K/V exchange plus the end-of-document flags, as the planner counts them
    planned = plan_layout(tiny_config(MASK + over + [f"train.max_steps={STEPS}"], n), n).ranks[0]
    assert got["comm"][0]["cp"] == planned.cp_comm_bytes, (got["comm"][0], planned.cp_comm_bytes)


def flex_matches_sdpa(mesh, overrides: list[str]) -> float:
    """Max |logits| difference of this rank's tokens between the FlexAttention block mask and the SDPA
    mask, forward only (CPU has flex's forward alone); S = 256: cp2 chunks of 64, two to a flex tile."""
    from tests.forms import build_data, build_model, microbatches

    cfg = tiny_config(MASK + overrides + ["model.seq_length=256", "model.num_layers=1"], mesh.world)
    model = build_model(cfg, mesh).eval()
    data = build_data(cfg)
    model.set_documents(data.eos_ids)
    x_BS = microbatches(data, 0, 8, 2, 0, 1, cfg.train.seed, cp_rank=mesh.cp.rank, cp_size=mesh.cp.size)[0][0]
    out = {}
    with torch.no_grad():
        for kernel in ("sdpa", "flex"):
            model.doc_kernel = kernel
            out[kernel] = model(x_BS)
    return (out["flex"] - out["sdpa"]).abs().max().item()


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_block_mask_under_cp_allgather_matches_sdpa(pool):
    """CUDA's kernel under cp_comm=allgather (the rank's two query chunks against the gathered K/V put in
    global order, the block mask by global position and document) equals the SDPA mask path, every rank."""
    errs = pool.run(flex_matches_sdpa, 2, ["parallel.cp=2"], cp=2)
    assert max(errs) <= 1e-5, errs
