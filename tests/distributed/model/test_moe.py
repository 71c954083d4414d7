"""MoE under expert parallelism equals one process: the dispatcher's all-to-all autograd, training (losses,
step-1 grads, weights after 4 steps) for ep2 (ZeRO-1 and zero=0), ep4, tp2·sp·ep2 (dropless and with capacity)
and pp2·ep2, and a checkpoint written at ep2 resumed at ep1."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close
from tests.distributed.moe_cases import MOE, checkpoint_across_ep, dispatcher_vs_one_process, starve_experts

pytestmark = pytest.mark.distributed

STEPS = 4
# (name, ranks, tp, pp, ep, overrides): each layout also switches on one MoE option, checked against
# one process with the same option
LAYOUTS = [
    ("ep2", 2, 1, 1, 2, []),
    ("ep2-zero0", 2, 1, 1, 2, ["optim.zero=0"]),
    ("ep4-expert-bias", 4, 1, 1, 4, ["model.moe_expert_bias=true", "model.moe_bias_update_rate=0.01"]),
    ("tp2-sp-ep2", 4, 2, 1, 2, ["parallel.tp=2", "parallel.sp=true"]),
    (
        "tp2-sp-ep2-capacity",
        4,
        2,
        1,
        2,
        ["parallel.tp=2", "parallel.sp=true", "model.moe_capacity_factor=1.0"],
    ),
    ("pp2-ep2-sigmoid", 4, 1, 2, 2, ["parallel.pp=2", "model.moe_router_score=sigmoid"]),
]
LAYOUT_ONLY = ("parallel.tp", "parallel.sp", "parallel.pp", "parallel.ep")
_reference: dict = {}


def reference(pool, options: list[str]) -> dict:
    key = tuple(options)
    if key not in _reference:
        _reference[key] = pool.run(train_and_report, 1, MOE + options, STEPS)[0]
    return _reference[key]


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatcher_all_to_all_autograd_matches_one_process(pool, ep):
    errs = pool.run(dispatcher_vs_one_process, ep, [f"parallel.ep={ep}"], ep=ep)[0]
    scale = errs.pop("scale")
    # comm_bytes/ep: the rows that leave their rank, 4 crossings each, plus the counts exchange
    assert errs.pop("ep_bytes") == errs.pop("ep_bytes_theory") > 0
    assert errs["y"] < 1e-5 and errs["x_grad"] < 1e-5, errs
    for name, err in errs.items():
        assert err <= 1e-5 * max(scale, 1.0), (name, errs)


def test_dispatch_by_node_matches_one_process_and_crosses_nodes_once_per_token_and_node(pool):
    """parallel.ep_dispatch=node on 4 ranks of 2 nodes: the layer's output and grads equal one process's,
    and the bytes between nodes are a row per (token, other node it needs), fewer than the plain
    dispatcher's row per (token, expert there) once a token has two experts on the other node."""
    over = ["parallel.ep=4", "parallel.ep_dispatch=node", "parallel.ranks_per_node=2"]
    errs = pool.run(dispatcher_vs_one_process, 4, over, ep=4, node=2)[0]
    scale, rows, plain = errs.pop("scale"), errs.pop("node_row_bytes"), errs.pop("plain_node_row_bytes")
    assert errs.pop("ep_bytes") == errs.pop("ep_bytes_theory") > 0
    assert 0 < rows < plain, (rows, plain)
    for name, err in errs.items():
        assert err <= 1e-5 * max(scale, 1.0), (name, errs)


@pytest.mark.parametrize("name,n,tp,pp,ep,extra", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_moe_layout_matches_one_process(pool, name, n, tp, pp, ep, extra):
    options = [o for o in extra if not o.startswith(LAYOUT_ONLY)]
    ref = reference(pool, options)
    got = pool.run(train_and_report, n, MOE + extra + [f"parallel.ep={ep}"], STEPS, tp=tp, pp=pp, ep=ep)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
    if ep > 1:
        assert all(c.get("ep", 0) > 0 for c in got["comm"]), got["comm"]


# (saved: ranks, pool layout, overrides), (resumed: the same): expert shards written under one ep/etp
# layout load under another (the checkpoint holds global expert tensors: any fold reads its own slices)
FOLD = ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]
RESHARD = [
    ((2, dict(ep=2), ["parallel.ep=2"]), (1, {}, [])),
    ((4, dict(ep=2, etp=2), ["parallel.ep=2", "parallel.etp=2"]), (2, dict(tp=2, ep=2), FOLD)),
]


@pytest.mark.parametrize("saved,resumed", RESHARD, ids=["ep2-to-ep1", "ep2.etp2-to-tp2.ep2"])
def test_expert_checkpoint_resumes_under_another_fold(pool, tmp_path, saved, resumed):
    over = MOE + ["model.moe_expert_bias=true", "model.moe_bias_update_rate=0.01"]
    whole = pool.run(checkpoint_across_ep, 1, over, str(tmp_path / "whole"), 4, 4)[0]
    (n, kw, layout), (m, kw2, layout2) = saved, resumed
    pool.run(checkpoint_across_ep, n, over + layout, str(tmp_path / "ck"), 4, 2, **kw)
    resumed = pool.run(checkpoint_across_ep, m, over + layout2, str(tmp_path / "ck"), 4, 2, **kw2)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(resumed["losses"], whole["losses"][2:])]
    assert max(rel) <= 1e-5, (resumed["losses"], whole["losses"])
    assert_weights_close(resumed["weights"], whole["weights"])


@pytest.mark.parametrize("node", [0, 1], ids=["all-to-all", "by-node"])
def test_starved_experts_update_like_one_process(pool, node):
    """Experts 2 and 3 (ep rank 1's) never get a token: their zero grads still go through ZeRO over
    edp, and AdamW's weight decay moves them exactly as in one process. By node (a rank a node), rank 1
    is sent nothing and sends nothing back: every all-to-all of the rail carries empty blocks."""
    over = MOE + ["model.moe_expert_bias=true", "model.moe_bias_update_rate=0"]
    ref = pool.run(train_and_report, 1, over, 2, starve_experts)[0]
    by_node = ["parallel.ep_dispatch=node", f"parallel.ranks_per_node={node}"] if node else []
    got = pool.run(
        train_and_report, 2, over + ["parallel.ep=2", *by_node], 2, starve_experts, ep=2, node=node
    )[0]
    up = "layers.0.mlp.experts.up_proj.weight"
    assert ref["grads"][up][2:].abs().max() == 0 and ref["grads"][up][:2].abs().max() > 0
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref["losses"])) <= 1e-5
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
