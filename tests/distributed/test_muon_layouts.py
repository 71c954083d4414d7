"""optim.name=muon across layouts against one process (optim/muon.py): tensor-parallel slices gathered for the
orthogonalisation (tp2, sp), and ZeRO's owned ranges summed into whole matrices over dp (zero=1 dp2,
zero=3 dp2). One process itself equals torch.optim.Muon (tests/unit/optim/test_muon.py)."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.test_model_equivalence import assert_close_dicts
from tests.distributed.test_zero import rel_errors

pytestmark = pytest.mark.distributed

STEPS = 2
LR = 0.02
MUON = ["optim.name=muon", f"optim.lr={LR}", "optim.muon.adamw_lr=3e-3", "optim.warmup_steps=0"]
# (ranks, tp, overrides)
LAYOUTS = {
    "tp2-sp": (2, 2, ["optim.zero=0", "parallel.tp=2", "parallel.sp=true"]),
    "zero1-dp2": (2, 1, ["optim.zero=1", "optim.bucket_size_mb=0.01"]),
    "zero3-dp2": (2, 1, ["optim.zero=3"]),
}
_reference: dict = {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layout_matches_one_process(pool, layout):
    if not _reference:
        _reference["one"] = pool.run(train_and_report, 1, MUON + ["optim.zero=0"], STEPS)[0]
    ref = _reference["one"]
    n, tp, over = LAYOUTS[layout]
    got = pool.run(train_and_report, n, MUON + over, STEPS, tp=tp)[0]
    worst = max(rel_errors(got["losses"], ref["losses"]))
    print(f"muon {layout}: max rel loss diff {worst:.2e}")
    assert worst <= 1e-5, (got["losses"], ref["losses"])
    # ZeRO's summed ranges give the one-process direction bit for bit. Under tp the grads differ from one
    # process's by ~1e-7 (other reduction order), which can flip the bf16 rounding of Newton-Schulz
    # (torch's, in bf16): a few bf16 ulps of an orthogonalised entry (<= 0.5), each lr / 512 of a weight
    atol = 1e-4 if tp == 1 else STEPS * LR * 2**-6
    assert_close_dicts(got["weights"], ref["weights"], rtol=1e-4, atol=atol, what="weight")
