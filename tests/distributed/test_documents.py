"""data.document_mask under tp·sp, pp, dp and recompute: the one-process losses (1e-5), grads and weights.
Synthetic data ends documents at ids that are multiples of 64: at seq 32 about 40 % of the samples hold a
boundary, anywhere in the sequence (at tp/sp chunk edges too; tests/unit/test_documents.py pins one at S/2)."""
import pytest
import torch

from tests.distributed.cases import train_and_report

pytestmark = pytest.mark.distributed

STEPS = 4
MASK = ["data.document_mask=true"]
_ref: dict = {}

LAYOUTS = [  # (name, ranks, tp, pp, overrides)
    ("tp2-sp", 2, 2, 1, ["parallel.tp=2", "parallel.sp=true"]),
    ("tp2-dp2-sp-selective", 4, 2, 1, ["parallel.tp=2", "parallel.sp=true", "train.recompute=selective"]),
    ("pp2-full", 2, 1, 2, ["parallel.pp=2", "train.recompute=full"]),
    ("learned-tp2-sp-pp2", 4, 2, 2, ["model=gpt2_tiny", "model.num_query_groups=null", "parallel.tp=2", "parallel.sp=true",
                                     "parallel.pp=2"]),
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
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    for k in ref["grads"]:
        torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=1e-4, atol=1e-6)
    for k in ref["weights"]:
        torch.testing.assert_close(got["weights"][k], ref["weights"][k], rtol=1e-4, atol=1e-4)
