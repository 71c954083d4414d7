"""Pipeline layouts train exactly like one process, under NCCL's point-to-point rules (the suite runs
MEGAFRAME_P2P_SEMANTICS=nccl, tests/conftest.py): 1F1B, interleaved and GPipe, pp 2 and 4, vpp 1-3,
micro-batch counts from pp to 4·pp, with tp/sp, dp (ZeRO-1), ep, both model families; evaluation's
forward-only walk too. And the mode bites: the exchange before the fix trains on NaN under it."""

import math
import os

import pytest

from megaframe.parallel.p2p_semantics import ENV_VAR, P2PSemantics
from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close
from tests.distributed.moe_cases import MOE
from tests.distributed.pipeline_cases import emulates_nccl, train_with_old_exchange, val_loss

pytestmark = pytest.mark.distributed

# three steps: step 1's loss and grads (the schedule's forward and backward), then two updates (the second
# reads Adam moments and whatever the schedule kept from the step before: buffers, p2p state, caches) and the
# weights after three; more steps only repeat the same schedule
STEPS = 3
FAMILY_OVERRIDES = {"gpt_tiny": [], "gpt2_tiny": ["model=gpt2_tiny", "model.num_query_groups=null"]}
L4, L8, MB1 = "model.num_layers=4", "model.num_layers=8", "train.micro_batch_size=1"
ZB1, ZBV = "parallel.pp_schedule=zb_h1", ["parallel.pp_schedule=zbv", "parallel.vpp=2"]
OVERLAP = "parallel.pp_schedule=interleaved_overlap"
# (name, ranks, tp, pp, ep, overrides); the tiny model has 2 layers and 4 micro-batches of 2 (8 at dp=1)
# unless overridden; m = micro-batches per dp rank
LAYOUTS = [
    ("1f1b-pp2-m2", 2, 1, 2, 1, ["train.micro_batch_size=4"]),
    ("1f1b-pp2-m8", 2, 1, 2, 1, [MB1]),
    ("1f1b-pp4-m4", 4, 1, 4, 1, [L4]),
    ("1f1b-pp4-m16", 4, 1, 4, 1, [L4, "train.global_batch_size=16", MB1]),
    ("interleaved-pp2-vpp2-m4", 2, 1, 2, 1, ["parallel.vpp=2", L4]),
    ("interleaved-pp2-vpp3-m8", 2, 1, 2, 1, ["parallel.vpp=3", "model.num_layers=6", MB1]),
    ("interleaved-pp4-vpp2-m4", 4, 1, 4, 1, ["parallel.vpp=2", L8]),
    ("interleaved-pp4-vpp3-m8", 4, 1, 4, 1, ["parallel.vpp=3", "model.num_layers=12", MB1]),
    ("gpipe-pp2-m4", 2, 1, 2, 1, ["parallel.pp_schedule=gpipe"]),
    ("gpipe-pp2-vpp2-m8", 2, 1, 2, 1, ["parallel.pp_schedule=gpipe", "parallel.vpp=2", L4, MB1]),
    ("gpipe-pp4-vpp2-m8", 4, 1, 4, 1, ["parallel.pp_schedule=gpipe", "parallel.vpp=2", L8, MB1]),
    # tp2-sp-pp2 itself: every family's, tests/distributed/models/test_family_conformance.py
    ("tp2-sp-pp2-vpp2", 4, 2, 2, 1, ["parallel.sp=true", "parallel.vpp=2", L4]),
    ("pp2-dp2-zero1-m2", 4, 1, 2, 1, []),
    ("interleaved-pp2-vpp2-dp2-zero1", 4, 1, 2, 1, ["parallel.vpp=2", L4]),
    ("pp2-uneven", 2, 1, 2, 1, [L4, "parallel.pp_layout=[3,1]"]),
    ("moe-interleaved-pp2-vpp2-ep2", 4, 1, 2, 2, MOE + ["parallel.vpp=2", L4]),
    # zero-bubble: B and W split, W at the schedule's place; zbv's V with rank 0 at both ends
    ("zb_h1-pp2-m2", 2, 1, 2, 1, [ZB1, "train.micro_batch_size=4"]),
    ("zb_h1-pp4-m8", 4, 1, 4, 1, [ZB1, L4, MB1]),
    ("zb_h1-tp2-sp-pp2", 4, 2, 2, 1, [ZB1, "parallel.sp=true"]),
    ("zbv-tp2-sp-overlap-pp2", 4, 2, 2, 1, [*ZBV, L4, "parallel.sp=true", "parallel.tp_comm_overlap=true"]),
    ("zb_h1-pp2-dp2-zero1", 4, 1, 2, 1, [ZB1]),
    ("zb_h1-pp2-dp2-zero3", 4, 1, 2, 1, [ZB1, "optim.zero=3"]),
    ("zbv-pp2-dp2-zero2", 4, 1, 2, 1, [*ZBV, L4, "optim.zero=2"]),
    (
        "zb_h1-pp2-uneven-recompute-full",
        2,
        1,
        2,
        1,
        [ZB1, L4, "parallel.pp_layout=[3,1]", "train.recompute=full"],
    ),
    ("moe-zb_h1-pp2-ep2", 4, 1, 2, 2, MOE + [ZB1]),
    # a forward beside a backward over 4 stages (MoE layouts: test_forward_beside_backward.py)
    ("interleaved_overlap-pp4-vpp2-m8", 4, 1, 4, 1, [OVERLAP, "parallel.vpp=2", L8, MB1]),
    ("zbv-pp2-m4", 2, 1, 2, 1, [*ZBV, L4]),
    # a 0-layer virtual stage in the middle of the V hands its input on: B returns the output's gradient
    ("zbv-pp2-empty-middle-stage", 2, 1, 2, 1, [*ZBV, L4, "parallel.pp_layout=[2,0,1,1]"]),
    (
        "zbv-pp4-m8-uneven-selective",
        4,
        1,
        4,
        1,
        [
            *ZBV,
            "model.num_layers=10",
            "parallel.pp_layout=[1,2,1,1,1,1,2,1]",
            MB1,
            "train.recompute=selective",
        ],
    ),
]
GPT2 = {
    "1f1b-pp2-m8",
    "interleaved-pp4-vpp2-m4",
    "gpipe-pp2-vpp2-m8",
    "pp2-dp2-zero1-m2",
    "zb_h1-pp2-m2",
    "zbv-pp2-m4",
}
CASES = [
    pytest.param(family, *layout, id=f"{layout[0]}-{family}")
    for layout in LAYOUTS
    for family in FAMILY_OVERRIDES
    if family == "gpt_tiny" or layout[0] in GPT2
]
_reference: dict = {}


def reference(pool, options: list[str]) -> dict:
    """One process with the same model and batch options (layout keys dropped)."""
    key = tuple(options)
    if key not in _reference:
        _reference[key] = pool.run(train_and_report, 1, options, STEPS)[0]
    return _reference[key]


def _model_options(family: str, extra: list[str]) -> list[str]:
    return FAMILY_OVERRIDES[family] + [o for o in extra if not o.startswith("parallel.")]


@pytest.mark.parametrize("family,name,n,tp,pp,ep,extra", CASES)
def test_pipeline_matches_one_process(pool, family, name, n, tp, pp, ep, extra):
    ref = reference(pool, _model_options(family, extra))
    over = FAMILY_OVERRIDES[family] + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", *extra]
    lanes = 2 if OVERLAP in extra else 1
    got = pool.run(train_and_report, n, over, STEPS, tp=tp, pp=pp, ep=ep, lanes=lanes)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert len(rel) == STEPS and max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])


def test_every_registered_kind_trains_like_one_process_somewhere():
    """A kind registered in pipeline/schedule.py gets a multi-rank run against one process: here, or
    (the overlapped kinds' MoE layouts) in test_forward_beside_backward.py."""
    from megaframe.pipeline.schedule import SCHEDULES
    from tests.distributed.pipeline.test_forward_beside_backward import LAYOUTS as OVERLAPPED

    named = {o.split("=", 1)[1] for *_, extra in LAYOUTS + OVERLAPPED for o in extra if "pp_schedule=" in o}
    # parallel.pp_schedule=auto: 1f1b, or interleaved with chunks
    assert set(SCHEDULES) <= named | {"1f1b", "interleaved"}, set(SCHEDULES) - named


def test_the_suite_runs_pipelines_under_nccl_semantics(pool):
    if os.environ.get(ENV_VAR) != P2PSemantics.NCCL.value:
        pytest.skip(f"{ENV_VAR} overridden by the caller")
    assert all(pool.run(emulates_nccl, 2, pp=2))
    assert not any(pool.run(emulates_nccl, 2, pp=2, p2p="native"))


def test_interleaved_matches_one_process_on_plain_gloo(pool):
    """The backend's own semantics (what a GPU run uses, with NCCL): one Work per op on gloo, each waited
    once (a gloo Work waited twice would wait for a transfer that never comes)."""
    extra = ["parallel.vpp=2", L4]
    ref = reference(pool, _model_options("gpt_tiny", extra))
    got = pool.run(train_and_report, 2, ["parallel.pp=2", *extra], STEPS, pp=2, p2p="native")[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-5


def test_old_exchange_trains_on_nan_under_nccl_semantics(pool):
    """Waiting on works[len(sends):] waits on nothing when NCCL returns one Work for a
    batch that sends and receives, so the next compute reads the receive buffer unfilled (NaN here)."""
    got = pool.run(train_with_old_exchange, 2, ["parallel.pp=2"], 2, pp=2, p2p="nccl")[0]
    assert not any(math.isfinite(x) for x in got["losses"]), got["losses"]
    fixed = pool.run(train_and_report, 2, ["parallel.pp=2"], 2, pp=2, p2p="nccl")[0]
    assert all(math.isfinite(x) for x in fixed["losses"]), fixed["losses"]


EVAL_LAYOUTS = [
    ("pp4-vpp2", 4, 1, 4, ["parallel.vpp=2", L8]),
    ("tp2-sp-pp2-vpp2", 4, 2, 2, ["parallel.sp=true", "parallel.vpp=2", L4]),
    ("pp2-dp2", 4, 1, 2, []),
    ("zbv-pp4", 4, 1, 4, [*ZBV, L8]),
]


@pytest.mark.parametrize("name,n,tp,pp,extra", EVAL_LAYOUTS, ids=[x[0] for x in EVAL_LAYOUTS])
def test_evaluation_walk_matches_one_process(pool, name, n, tp, pp, extra):
    ref = pool.run(val_loss, 1, [o for o in extra if not o.startswith("parallel.")])[0]
    got = pool.run(val_loss, n, [f"parallel.tp={tp}", f"parallel.pp={pp}", *extra], tp=tp, pp=pp)[0]
    assert abs(got - ref) <= 1e-5 * ref, (got, ref)
