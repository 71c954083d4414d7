"""The overlapped pipeline kinds (1f1b_overlap, interleaved_overlap: a forward beside another
micro-batch's backward, each on its own lane of communicators) train like one process: losses, step-1
grads, the final weights, the grad norms and the router figures, in MoE layouts whose all-to-alls, tp/sp
and cp collectives run on both lanes at once. Equal, bit for bit, to the kind they overlap; and the pairs
did run at once."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.overlap_cases import pairs_at_once, report_switching_often
from tests.distributed.parallel.test_context_parallel import STEPS, check

pytestmark = pytest.mark.distributed

# 4 layers (2 chunks of 2 ranks); 16 sequences: the interleaved layout's first rank gets a steady state
MOE = ["model=moe_tiny", "model.num_layers=4", "optim.clip_grad=0.3", "train.global_batch_size=16"]
_reference: dict = {}

# (name, ranks, mesh, overrides): the overlapped kind with the layout's collectives on both lanes
LAYOUTS = [
    ("ep2", 2, {"ep": 2}, ["parallel.ep=2", "parallel.pp_schedule=1f1b_overlap"]),
    (
        "tp2-sp-ep2-zero1",
        2,
        {"tp": 2, "ep": 2},
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.ep=2",
            "optim.zero=1",
            "parallel.pp_schedule=1f1b_overlap",
        ],
    ),
    (
        "ring-cp2-ep2",
        2,
        {"cp": 2, "ep": 2},
        ["parallel.cp=2", "parallel.cp_comm=ring", "parallel.ep=2", "parallel.pp_schedule=1f1b_overlap"],
    ),
    (
        "pp2-vpp2-dp2-ep2-zero2",
        4,
        {"pp": 2, "ep": 2},
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.ep=2",
            "optim.zero=2",
            "parallel.pp_schedule=interleaved_overlap",
        ],
    ),
]


def reference(pool) -> dict:
    if "ref" not in _reference:
        _reference["ref"] = pool.run(train_and_report, 1, MOE, STEPS)[0]
    return _reference["ref"]


@pytest.mark.parametrize("name,n,mesh,extra", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_overlapped_kind_matches_one_process(pool, name, n, mesh, extra):
    got = pool.run(train_and_report, n, MOE + extra, STEPS, lanes=2, **mesh)[0]
    ref = reference(pool)
    check(got, ref)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), (got["norms"], ref["norms"])
    for key, want in ref["moe"].items():
        assert got["moe"][key] == pytest.approx(want, rel=1e-5, abs=1e-9), (key, got["moe"][key], want)
    # the pairs ran at once, each side's collectives on its own lane (at least one pair's spans intersect:
    # on a loaded machine a tiny pair's forward may start only as its backward ends)
    spans = pool.run(pairs_at_once, n, MOE + extra, lanes=2, **mesh)[0]
    assert spans["pairs"] > 0 and spans["at_once"] >= 1, spans
    assert min(spans["on_lane"]) > 0, spans


BIT_EQUAL = [
    ("tp2-sp-ep2", {"tp": 2, "ep": 2}, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
    # the ring's backward draws its dropout mask again while the paired forward draws its own: from a
    # generator of its own, not by setting and restoring the default one under the forward's feet
    (
        "ring-cp2-ep2-dropout",
        {"cp": 2, "ep": 2},
        ["parallel.cp=2", "parallel.cp_comm=ring", "parallel.ep=2", "model.dropout=0.1"],
    ),
]


@pytest.mark.parametrize("name,mesh,extra", BIT_EQUAL, ids=[b[0] for b in BIT_EQUAL])
def test_overlap_changes_no_bit_of_the_kind_it_overlaps(pool, name, mesh, extra):
    """The same work in the same order on each thread: 1f1b_overlap gives 1f1b's figures exactly."""
    plain = pool.run(report_switching_often, 2, MOE + extra, STEPS, **mesh)[0]
    over = pool.run(
        report_switching_often, 2, MOE + extra + ["parallel.pp_schedule=1f1b_overlap"], STEPS, lanes=2, **mesh
    )[0]
    assert over["losses"] == plain["losses"] and over["norms"] == plain["norms"]
    for key, want in plain["weights"].items():
        assert over["weights"][key].equal(want), key
