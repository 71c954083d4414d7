"""The dry-run planner against the real per-rank memory of small runs on the gloo pool: params, grads
and optimizer state as the trainer logs them, and activations saved for backward (per micro-batch and
at the peak of the real pipeline schedule), each within 10 %; under ep the per-micro-batch bytes summed
over the ranks, to the byte."""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.plan_cases import measure_memory, mesh_coordinates

pytestmark = pytest.mark.distributed

# (name, ranks, tp, pp, overrides)
LAYOUTS = [
    ("tp2-dp2-zero0", 4, 2, 1, ["parallel.tp=2", "optim.zero=0"]),
    (
        "pp2-dp2-zero1-bf16",
        4,
        1,
        2,
        ["parallel.pp=2", "train.precision=bf16", "optim.bucket_size_mb=0.01", "train.global_batch_size=16"],
    ),
    ("tp2-dp2-sp", 4, 2, 1, ["parallel.tp=2", "parallel.sp=true"]),
    ("pp2-vpp2-tp2", 4, 2, 2, ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"]),
    ("moe-ep2-dp4", 4, 1, 1, ["model.family=mixtral", "model.num_experts=4", "parallel.ep=2"]),
    # a forward beside a backward: one chunk more in flight, the worker's saved tensors counted too
    (
        "moe-ep2-dp4-1f1b-overlap",
        4,
        1,
        1,
        [
            "model.family=mixtral",
            "model.num_experts=4",
            "parallel.ep=2",
            "train.global_batch_size=32",
            "parallel.pp_schedule=1f1b_overlap",
        ],
    ),
    (
        "pp2-vpp2-tp2-interleaved-overlap",
        4,
        2,
        2,
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.vpp=2",
            "model.num_layers=4",
            "train.global_batch_size=16",
            "parallel.pp_schedule=interleaved_overlap",
        ],
    ),
    ("dp4-hsdp2-zero2", 4, 1, 1, ["optim.zero=2", "optim.shard_group_size=2", "optim.bucket_size_mb=0.01"]),
    (
        "pp2-dp2-zero2-tied",
        4,
        1,
        2,
        [
            "model=gpt2_tiny",
            "model.num_query_groups=null",
            "parallel.pp=2",
            "optim.zero=2",
            "optim.bucket_size_mb=0.01",
        ],
    ),
]
TOL = 0.10


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1)


@pytest.mark.parametrize("name,n,tp,pp,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_planner_matches_measured_memory(pool, name, n, tp, pp, extra):
    ep = next((int(o.split("=")[1]) for o in extra if o.startswith("parallel.ep=")), 1)
    shard = next((int(o.split("=")[1]) for o in extra if o.startswith("optim.shard_group_size=")), 0)
    lanes = 2 if any(o.endswith("_overlap") for o in extra) else 1
    measured = pool.run(measure_memory, n, extra, tp=tp, pp=pp, ep=ep, shard=shard, lanes=lanes)
    plan = plan_layout(tiny_config(extra, n), n)
    planned = {(r.pp_rank, r.tp_rank): r for r in plan.ranks}
    report, per_mb = [], [0, 0]
    for rank, got in enumerate(measured):
        want = planned[(got["pp_rank"], got["tp_rank"])]
        assert rank in want.ranks
        assert got["live_after"] == 0, "activations left over after the step"
        pairs = {
            "params": (want.params_bytes, got["mem/params_bytes"]),
            "grads": (want.grads_bytes, got["mem/grads_bytes"]),
            "optim": (want.optim_bytes, got["mem/optim_bytes"]),
            "act/microbatch": (sum(want.chunk_activation_bytes), sum(got["chunk_activation_bytes"])),
            "activations": (want.activation_bytes, got["activation_peak_bytes"]),
        }
        total_got = sum(v[1] for k, v in pairs.items() if k != "act/microbatch")
        pairs["total"] = (want.total_bytes, total_got)
        errors = {k: rel(p, m) for k, (p, m) in pairs.items()}
        report.append(
            f"{name} rank {rank}: "
            + ", ".join(f"{k} {p}/{m} ({100 * errors[k]:.1f}%)" for k, (p, m) in pairs.items())
        )
        if lanes > 1:
            # a pair's forward saves on the worker while its backward frees here: the peak lies between the
            # base kind's order (the forward after the backward) and the planner's, the backward's tensors
            # all held until the forward's are saved (what a plan that says `fits` must assume)
            base = plan_layout(tiny_config([o for o in extra if "pp_schedule" not in o], n), n)
            floor = {(r.pp_rank, r.tp_rank): r.activation_bytes for r in base.ranks}
            low = floor[(got["pp_rank"], got["tp_rank"])]
            assert low < got["activation_peak_bytes"] <= want.activation_bytes, (low, report[-1])
            errors.pop("activations"), errors.pop("total")
        if ep > 1:
            # The per-micro-batch probe feeds all-zero ids: every token picks the same experts, the worst
            # imbalance, where the planner assumes balance. What a rank keeps grows with the rows its
            # experts receive alone, and the rows are conserved over the ep group: summed over the ranks,
            # planned and measured are the same bytes.
            per_mb = [per_mb[0] + pairs["act/microbatch"][0], per_mb[1] + pairs["act/microbatch"][1]]
            errors.pop("act/microbatch")
        assert max(errors.values()) <= TOL, report[-1]
    print("\n" + "\n".join(report))
    assert per_mb[0] == per_mb[1], f"act/microbatch over the ranks: planned {per_mb[0]}, measured {per_mb[1]}"


@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 1), (1, 2, 2), (1, 1, 4), (2, 1, 2)])
def test_virtual_mesh_is_the_real_mesh(pool, tp, pp, ep):
    """The planner's virtual mesh of every rank has the real groups' members, coordinates and counters."""
    from megaframe.parallel.virtual import virtual_mesh

    for got in pool.run(mesh_coordinates, 4, tp=tp, pp=pp, ep=ep):
        p, d, t = got["coord"]
        want = mesh_coordinates(virtual_mesh(tp, pp, 4 // (tp * pp), t, p, d, device="cpu", ep=ep))
        assert want == got, (tp, pp, ep, got, want)


def test_dispatch_by_node_keeps_what_the_plain_dispatch_keeps(pool):
    """The planner sizes an MoE layer by the plain dispatch's saved tensors (its meta forward runs that
    path). By node (ep4 over 2 emulated nodes) a rank keeps the same rows for backward; what it adds is
    int64 indices: the (token, node) pairs' tokens (P <= T·N) and the received pairs' assignment order and
    tokens, marked ones included (2·R·K, R <= N·T), 8 bytes each, per MoE layer and micro-batch. Summed
    over the ranks the extra stays within that; one saved copy of the routed rows on each rank would not."""
    over = ["model.family=mixtral", "model.num_experts=4", "parallel.ep=4"]
    plain = pool.run(measure_memory, 4, over, ep=4)
    by_node = pool.run(measure_memory, 4, [*over, "parallel.ep_dispatch=node"], ep=4, node=2)
    cfg = tiny_config(over, 4)
    t, k, n = cfg.model.seq_length * cfg.train.micro_batch_size, cfg.model.moe_top_k, 2
    indices = cfg.model.num_layers * 8 * (t * n + 2 * (n * t) * k)
    extra = sum(
        sum(b["chunk_activation_bytes"]) - sum(a["chunk_activation_bytes"]) for a, b in zip(plain, by_node)
    )
    rows = cfg.model.num_layers * t * k * cfg.model.hidden_size * 4
    assert 0 <= extra <= 4 * indices < 4 * rows, (extra, indices, rows)
    for a, b in zip(plain, by_node):
        assert b["live_after"] == 0 and b["activation_peak_bytes"] <= a["activation_peak_bytes"] + indices
