"""Pipeline layouts (1F1B, interleaved, GPipe; with tp/sp and dp) train exactly like one process."""
import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.test_model_equivalence import STEPS, assert_close_dicts, reference

pytestmark = pytest.mark.distributed

FAMILY_OVERRIDES = {"gpt_tiny": [], "gpt2_tiny": ["model=gpt2_tiny", "model.num_query_groups=null"]}
# (name, ranks, tp, pp, overrides); the tiny model has 2 layers unless overridden
LAYOUTS = [
    ("pp2", 2, 1, 2, []),
    ("pp2-vpp2", 2, 1, 2, ["parallel.vpp=2", "model.num_layers=4"]),
    ("pp4-vpp2", 4, 1, 4, ["parallel.vpp=2", "model.num_layers=8"]),
    ("tp2-pp2-sp", 4, 2, 2, ["parallel.sp=true"]),
    ("pp2-dp2", 4, 1, 2, []),
    ("pp2-gpipe", 2, 1, 2, ["parallel.pp_schedule=gpipe"]),
    ("pp2-uneven", 2, 1, 2, ["model.num_layers=4", "parallel.pp_layout=[3,1]"]),
]


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
@pytest.mark.parametrize("name,n,tp,pp,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_pipeline_matches_one_process(pool, family, name, n, tp, pp, extra):
    layers = [o for o in extra if o.startswith("model.num_layers")]
    ref = reference(pool, family) if not layers else pool.run(
        train_and_report, 1, FAMILY_OVERRIDES[family] + layers, STEPS)[0]
    over = FAMILY_OVERRIDES[family] + [f"parallel.tp={tp}", f"parallel.pp={pp}", *extra]
    got = pool.run(train_and_report, n, over, STEPS, tp=tp, pp=pp)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_close_dicts(got["weights"], ref["weights"], rtol=1e-4, atol=1e-4, what="weight")
