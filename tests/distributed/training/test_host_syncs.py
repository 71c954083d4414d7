"""No host sync in a training step outside log steps, except the MoE split sizes (one per MoE layer and
micro-batch; under cp too), and no collective over the whole job every step: counted on CPU by
tests/distributed/ sync_count.py over the real trainer loop (stop flag, async checkpoint commit, bad-step
checks).

Steps 1 (first), 2 and 4 (checkpoint saves) and 6 (log, last) may sync; steps 3 and 5 are plain
steps, with an async save pending since step 2 or 4 (checkpoint.interval=2, checkpoint.async=true).
"""

import pytest

from tests.distributed.moe_cases import MOE
from tests.distributed.sync_count import syncs_per_step

pytestmark = pytest.mark.distributed

STEPS = 6
PLAIN_STEPS = (3, 5)
CKPT = ["checkpoint.interval=2", "checkpoint.async=true"]
# (name, ranks, tp, pp, ep, overrides, MoE layers on the busiest rank)
LAYOUTS = [
    ("dense-1proc", 1, 1, 1, 1, [], 0),
    ("moe-1proc", 1, 1, 1, 1, MOE, 2),
    ("dense-tp2-pp2", 4, 2, 2, 1, ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true"], 0),
    # bf16 grad reduction: grad32's storage is resized and filled on the device every step, no sync
    (
        "dense-dp2-zero2-bf16-reduce",
        2,
        1,
        1,
        1,
        ["train.precision=bf16", "optim.zero=2", "optim.grad_reduce_dtype=bf16"],
        0,
    ),
    ("moe-ep2", 2, 1, 1, 2, MOE + ["parallel.ep=2"], 2),
    (
        "moe-tp2-sp-ep2-capacity",
        4,
        2,
        1,
        2,
        MOE + ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "model.moe_capacity_factor=1.0"],
        2,
    ),
    # MoE under cp: the run counts gathered over cp, capacity's run-order mask built once (first step)
    (
        "moe-cp2-ep2-capacity",
        2,
        1,
        1,
        2,
        MOE + ["parallel.cp=2", "parallel.ep=2", "model.moe_capacity_factor=1.0"],
        2,
    ),
    # dispatch by node over two emulated nodes: each of its two all-to-alls needs its split sizes, 2 syncs
    (
        "moe-ep4-by-node",
        4,
        1,
        1,
        4,
        MOE + ["parallel.ep=4", "parallel.ep_dispatch=node", "parallel.ranks_per_node=2"],
        2,
    ),
    # document masking under cp: the end flags' all-gather and the per-block masks read nothing back
    (
        "dense-cp2-ring-document-mask",
        2,
        1,
        1,
        1,
        ["parallel.cp=2", "parallel.cp_comm=ring", "data.document_mask=true"],
        0,
    ),
]


@pytest.mark.parametrize("name,n,tp,pp,ep,over,moe_layers", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_host_syncs_per_step_within_budget(pool, tmp_path, name, n, tp, pp, ep, over, moe_layers):
    cp = 2 if "parallel.cp=2" in over else 1
    node = 2 if "parallel.ep_dispatch=node" in over else 0
    args = (syncs_per_step, n, over + CKPT, STEPS, str(tmp_path))
    counts = pool.run(*args, tp=tp, pp=pp, ep=ep, cp=cp, node=node)[0]
    micro = 8 // (2 * (n // (tp * pp * cp)))  # global batch 8, micro-batch 2, over dp
    # the MoE split sizes: one .tolist() per MoE layer and micro-batch (by node: one per all-to-all, two)
    budget = moe_layers * micro * (2 if node else 1)
    print(name, {s: (len(c["syncs"]), len(c["world"])) for s, c in counts.items()})
    for s in PLAIN_STEPS:
        assert len(counts[s]["syncs"]) <= budget, (name, s, budget, counts[s]["syncs"])
        assert not counts[s]["world"], (name, s, counts[s]["world"])
    if moe_layers:  # the counter sees the one sync the split sizes need
        assert len(counts[PLAIN_STEPS[0]]["syncs"]) == budget, counts[PLAIN_STEPS[0]]["syncs"]
