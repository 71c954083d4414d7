"""MoE under context parallelism trains like one process: each cp rank routes the tokens it holds, the
router losses and capacity see the whole micro-batch (counts gathered over cp), and ep borrows its ranks
from cp·dp (expert grads over edp, dense ones over cp·dp). Losses (test_context_parallel's STEPS), step-1
grads and the final weights against one process, and the logged router figures (aux/z loss, per-expert
loads) of the last step, for cp_comm allgather and ring."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_weights_close
from tests.distributed.parallel.test_context_parallel import STEPS, check

pytestmark = pytest.mark.distributed

MOE = ["model=moe_tiny"]  # 8 experts, top-2, aux 0.01 and z 0.001 losses, on the tiny dims of cases.TINY
_reference: dict = {}


def reference(pool, options: tuple) -> dict:
    if options not in _reference:
        _reference[options] = pool.run(train_and_report, 1, MOE + list(options), STEPS)[0]
    return _reference[options]


# (name, cp, dp, ep, tp, overrides): ep = cp takes the cp group itself; ep = cp·dp spans cp and dp;
# ep = 2 at cp2·dp2 leaves edp = dp (each expert's grads summed over the two dp ranks holding it)
LAYOUTS = [
    ("cp2", 2, 1, 1, 1, []),
    ("cp2-ep2", 2, 1, 2, 1, []),
    ("ring-cp2-ep2-zero0-clip", 2, 1, 2, 1, ["parallel.cp_comm=ring", "optim.zero=0", "optim.clip_grad=0.3"]),
    ("cp2-dp2-ep2-zero1-clip", 2, 2, 2, 1, ["optim.zero=1", "optim.clip_grad=0.3"]),
    ("ring-cp2-dp2-ep4", 2, 2, 4, 1, ["parallel.cp_comm=ring"]),
    ("cp2-tp2-sp-ep2-capacity", 2, 1, 2, 2, ["parallel.sp=true", "model.moe_capacity_factor=1.0"]),
    # routed by global position, each rank's from its cp chunks and sp block: at 24 tokens the blocks start
    # at positions 0, 18, 6, 12, which local positions would route unlike one process (period E = 8)
    (
        "cp2-tp2-sp-ep2-forced-balance",
        2,
        1,
        2,
        2,
        ["parallel.sp=true", "model.moe_force_balance=true", "model.seq_length=24"],
    ),
    ("cp2-pp2-ep2-sigmoid", 2, 1, 2, 1, ["parallel.pp=2", "model.moe_router_score=sigmoid"]),
    # by node, 2 ranks a node: a token crosses to the other node once for its experts there (ep_rail), then
    # reaches them inside it (ep_node); under forced balance (experts p and p + 4) every token has one expert
    # on each node, so each crosses to the other node exactly once
    ("cp2-dp2-ep4-by-node", 2, 2, 4, 1, ["parallel.ep_dispatch=node", "parallel.ranks_per_node=2"]),
    (
        "cp2-tp2-sp-ep4-by-node-forced-balance",
        2,
        1,
        4,
        2,
        [
            "parallel.sp=true",
            "parallel.ep_dispatch=node",
            "parallel.ranks_per_node=2",
            "model.moe_force_balance=true",
        ],
    ),
    (
        "cp2-ep2-capacity-expert-bias",
        2,
        1,
        2,
        1,
        ["model.moe_capacity_factor=1.0", "model.moe_expert_bias=true", "model.moe_bias_update_rate=0.01"],
    ),
]
LAYOUT_ONLY = ("parallel.",)


@pytest.mark.parametrize("name,cp,dp,ep,tp,extra", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_moe_under_cp_matches_one_process(pool, name, cp, dp, ep, tp, extra):
    ref = reference(pool, tuple(o for o in extra if not o.startswith(LAYOUT_ONLY)))
    over = MOE + extra + [f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.tp={tp}"]
    pp = 2 if "parallel.pp=2" in extra else 1
    node = 2 if "parallel.ep_dispatch=node" in extra else 0
    got = pool.run(train_and_report, cp * dp * tp * pp, over, STEPS, tp=tp, cp=cp, ep=ep, pp=pp, node=node)[0]
    check(got, ref)
    # the global grad norm (clipping is active where clip_grad=0.3): each element counted once over ep x edp
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), (got["norms"], ref["norms"])
    # the logged router figures of the last step: aux and z losses, per-expert loads, drops, entropy
    assert got["moe"].keys() == ref["moe"].keys() and got["moe"]
    for key, want in ref["moe"].items():
        assert got["moe"][key] == pytest.approx(want, rel=1e-5, abs=1e-9), (key, got["moe"][key], want)
    if ep > 1:  # the tokens did cross the ep group
        assert all(c.get("ep", 0) > 0 for c in got["comm"]), got["comm"]


def test_cp_ep_checkpoint_resumes_in_one_process(pool, tmp_path):
    """Layout-free checkpoints with experts under cp: 2 steps at cp2·dp2·ep4 (ZeRO-1: expert moments
    sharded over edp, dense ones over cp·dp; the expert bias buffer), saved, one more in one process gives
    the uninterrupted one-process losses and weights (its loss reads the loaded weights and bias, its update
    the loaded moments)."""
    from tests.distributed.moe_cases import checkpoint_across_ep
    from tests.distributed.zero_cases import run_steps

    over = MOE + ["optim.zero=1", "model.moe_expert_bias=true", "model.moe_bias_update_rate=0.01"]
    whole = pool.run(run_steps, 1, over, 3)[0]  # (nothing to save: the uninterrupted run)
    pool.run(
        checkpoint_across_ep,
        4,
        over + ["parallel.cp=2", "parallel.ep=4"],
        str(tmp_path / "ck"),
        3,
        2,
        cp=2,
        ep=4,
    )
    resumed = pool.run(checkpoint_across_ep, 1, over, str(tmp_path / "ck"), 3, 2)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(resumed["losses"], whole["losses"][2:])]
    assert max(rel) <= 1e-5, (resumed["losses"], whole["losses"])
    assert_weights_close(resumed["weights"], whole["weights"])
