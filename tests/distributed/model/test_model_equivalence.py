"""Every tp x sp x dp layout trains the tiny models exactly like one process: losses, grads, weights."""

import pytest
import torch

from tests.distributed.cases import train_and_report

pytestmark = pytest.mark.distributed

# three steps: step 1's loss and grads, then two updates (the second reads the Adam moments the first wrote)
# and the weights after three
STEPS = 3
FAMILIES = {"gpt_tiny": [], "gpt2_tiny": ["model=gpt2_tiny", "model.num_query_groups=null"]}
# (tp, dp, sp): every layout of tp in {1,2,4} x sp x dp in {1,2} that fits 4 ranks
LAYOUTS = [
    (1, 2, False),
    (2, 1, False),
    (2, 1, True),
    (2, 2, False),
    (2, 2, True),
    (4, 1, False),
    (4, 1, True),
]
_reference: dict = {}


def _tiny(family):
    return FAMILIES[family]  # the tiny dims come from cases.TINY


def reference(pool, family):
    if family not in _reference:
        _reference[family] = pool.run(train_and_report, 1, _tiny(family), STEPS)[0]
    return _reference[family]


def assert_close_dicts(got, want, rtol, atol, what):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}"
        )


# the tiny cases' learning rate (tests/distributed/cases.py): the most one Adam step moves an element
ADAM_STEP = 3e-3


def assert_weights_close(got, want):
    """Weights after a few Adam steps: each element within 1e-4 (absolute and relative) of the reference,
    except at most one in 10,000 of a tensor (at least one), each within one Adam step.

    Adam divides by sqrt(v): where an element's grad is near zero, float32 reduction-order noise (which
    differs by layout and by the CPU's kernels) can flip the direction of its update, moving it by up to a
    step while every other element agrees to 1e-6; the grads themselves are held to 1e-6 beside this.
    """
    assert got.keys() == want.keys()
    for k in want:
        diff = (got[k] - want[k]).abs()
        off = diff > 1e-4 + 1e-4 * want[k].abs()
        allowed = max(1, off.numel() // 10_000)
        worst = diff.max().item() if diff.numel() else 0.0
        assert int(off.sum()) <= allowed and worst <= ADAM_STEP, (
            f"weight {k}: {int(off.sum())} of {off.numel()} elements past 1e-4 (at most {allowed}), "
            f"largest difference {worst:.3g} (at most one step, {ADAM_STEP})"
        )


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp,dp,sp", LAYOUTS, ids=[f"tp{t}-dp{d}{'-sp' if s else ''}" for t, d, s in LAYOUTS])
def test_layout_matches_one_process(pool, family, tp, dp, sp):
    ref = reference(pool, family)
    over = _tiny(family) + [f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"]
    got = pool.run(train_and_report, tp * dp, over, STEPS, tp=tp)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])


def test_loss_falls_on_synthetic(pool):
    ref = reference(pool, "gpt_tiny")
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_under_tp2_sp_matches_one_process(pool, recompute):
    """Recompute re-runs the blocks' forward collectives in backward; every tp rank does so in step."""
    ref = reference(pool, "gpt_tiny")
    over = ["parallel.tp=2", "parallel.sp=true", f"train.recompute={recompute}"]
    got = pool.run(train_and_report, 2, over, STEPS, tp=2)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")


def test_compile_under_tp2_sp_matches_one_process(pool):
    """Compiled blocks with the tp/sp collectives left eager between the compiled pieces."""
    ref = reference(pool, "gpt_tiny")
    over = ["parallel.tp=2", "parallel.sp=true", "train.compile=true"]
    got = pool.run(train_and_report, 2, over, STEPS, tp=2)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-5, what="grad")
