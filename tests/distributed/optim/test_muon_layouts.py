"""optim.name=muon across layouts against one process (optim/muon.py): tensor-parallel slices gathered for the
orthogonalisation (tp2, sp), pipeline stages (pp2), ZeRO's owned ranges sent to each matrix's owner and its
result's ranges sent back (zero=1 dp2, optim/muon_exchange.py), and MoE experts whole on their ep rank beside
ZeRO-sharded dense matrices (ep2, zero=1), and experts' ranges under ZeRO-3 (dp2). One process equals
torch.optim.Muon (tests/unit/optim/test_muon.py); zero=2 HSDP and zero=3 run in the conformance chain
(test_update_rules.py)."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts
from tests.distributed.optim.test_zero import rel_errors

pytestmark = pytest.mark.distributed

STEPS = 2
LR = 0.02
MUON = ["optim.name=muon", f"optim.lr={LR}", "optim.muon.adamw_lr=3e-3", "optim.warmup_steps=0"]
FAMILIES = {
    "dense": [],
    "moe": ["model=moe_tiny", "model.num_experts=4", "model.moe_ffn_hidden_size=48"],
}
# family, ranks, pool layout, overrides
LAYOUTS = {
    "tp2-sp": ("dense", 2, {"tp": 2}, ["optim.zero=0", "parallel.tp=2", "parallel.sp=true"]),
    "pp2": ("dense", 2, {"pp": 2}, ["optim.zero=0", "parallel.pp=2"]),
    "zero1-dp2": ("dense", 2, {}, ["optim.zero=1", "optim.bucket_size_mb=0.01"]),
    "ep2-zero1": ("moe", 2, {"ep": 2}, ["optim.zero=1", "parallel.ep=2"]),
    # the experts' ranges over a param whose storage ZeRO-3 frees between its gathers
    "zero3-dp2-moe": ("moe", 2, {}, ["optim.zero=3"]),
}
_reference: dict = {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layout_matches_one_process(pool, layout):
    family, n, kw, over = LAYOUTS[layout]
    if family not in _reference:
        one = MUON + FAMILIES[family] + ["optim.zero=0"]
        _reference[family] = pool.run(train_and_report, 1, one, STEPS)[0]
    ref = _reference[family]
    got = pool.run(train_and_report, n, MUON + FAMILIES[family] + over, STEPS, **kw)[0]
    worst = max(rel_errors(got["losses"], ref["losses"]))
    print(f"muon {layout}: max rel loss diff {worst:.2e}")
    assert worst <= 1e-5, (got["losses"], ref["losses"])
    # ZeRO's ranges, placed into the whole matrix by its owner, give the one-process direction bit for bit.
    # Under tp and ep the grads differ from one process's by ~1e-7 (other reduction orders), which can flip
    # the bf16 rounding of torch's Newton-Schulz: a few bf16 ulps of an orthogonalised entry (<= 0.5), each
    # lr / 512 of a weight
    atol = 1e-4 if not kw else STEPS * LR * 2**-6
    assert_close_dicts(got["weights"], ref["weights"], rtol=1e-4, atol=atol, what="weight")
