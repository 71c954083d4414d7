"""Every registered family (megaframe/models/registry.py) on its tiny preset trains under tp2.sp.pp2 (its
blocks split over heads and the sequence, cut between two pipeline stages, the tied embedding on both ends
where it ties) exactly like one process: both steps' losses (the second after an update) and step-1 grads.
Not the weights: Adam turns float32 reduction-order noise in a near-zero grad into a step of up to lr.
The one-process half of the conformance: tests/unit/models/test_family_conformance.py."""

import pytest

from megaframe.models.registry import FAMILIES
from tests.distributed.cases import TINY, train_and_report
from tests.distributed.test_model_equivalence import assert_close_dicts

pytestmark = pytest.mark.distributed

STEPS = 2
# cases.TINY's batch and run settings, the preset's own heads and widths (GPT-2 has no GQA)
BASE = [o for o in TINY if not o.startswith(("model.num_attention_heads", "model.num_query_groups"))]
BASE = [o for o in BASE if not o.startswith(("model.hidden_size", "model.ffn_hidden_size"))]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_sp_pp2_matches_one_process(pool, name):
    model = [f"model={FAMILIES[name].tiny}"]
    ref = pool.run(train_and_report, 1, model, STEPS, None, False, BASE)[0]
    over = model + ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"]
    got = pool.run(train_and_report, 4, over, STEPS, None, False, BASE, tp=2, pp=2)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert len(rel) == STEPS and max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")


# layouts beyond tp2.sp.pp2, run for the families whose block is their own (MLA's K and V of two widths
# through the cp kernels, document masks, ep with shared experts and group-limited routing): overrides,
# then the mesh (world, tp, cp, ep)
LAYOUTS = {
    "tp2.sp": (["parallel.tp=2", "parallel.sp=true"], dict(n=2, tp=2)),
    "ep2": (["parallel.ep=2"], dict(n=2, ep=2)),
    "cp2.ring.docs": (
        ["parallel.cp=2", "parallel.cp_comm=ring", "data.document_mask=true"],
        dict(n=2, cp=2),
    ),
    "cp2.allgather": (["parallel.cp=2", "parallel.cp_comm=allgather"], dict(n=2, cp=2)),
    "zero3.dp2": (["optim.zero=3"], dict(n=2)),
}
OWN_BLOCK = [name for name, spec in FAMILIES.items() if spec.block is not FAMILIES["llama"].block]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", OWN_BLOCK)
def test_layout_matches_one_process(pool, name, layout):
    over, mesh = LAYOUTS[layout]
    model = [f"model={FAMILIES[name].tiny}"] + [o for o in over if o.startswith("data.")]
    ref = pool.run(train_and_report, 1, model, STEPS, None, False, BASE)[0]
    n = mesh.pop("n")
    got = pool.run(train_and_report, n, model + over, STEPS, None, False, BASE, **mesh)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    print(f"{name} {layout}: max relative loss difference {max(rel):.2e}")
    assert len(rel) == STEPS and max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
