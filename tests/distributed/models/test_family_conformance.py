"""Every registered family (megaframe/models/registry.py) on its tiny preset trains under tp2.sp.pp2 (its
blocks split over heads and the sequence, cut between two pipeline stages, the tied embedding on both ends
where it ties) exactly like one process: both steps' losses (the second after an update) and step-1 grads.
Not the weights: Adam turns float32 reduction-order noise in a near-zero grad into a step of up to lr.
The one-process half of the conformance: tests/unit/models/test_family_conformance.py."""

import pytest

from megaframe.models.registry import FAMILIES
from tests.distributed.cases import TINY, train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts

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
