"""Every registered update rule (optim/rule_registry.py) in each optim.state_dtype under every distribution
strategy: zero=0, 1, 2 (here with HSDP), 3. One chain of short runs per rule and dtype, each loading the
previous one's checkpoint under a different layout and stage, continues one uninterrupted one-process run
(losses, final weights); the last link resumes into the other state dtype (converted as read). On every rank
of each run the optimizer state measured (mem/optim_bytes) equals the planner's (planning/memory/rank_state.py
plan_layout, from the config alone), and the checkpoint records the state's dtype."""

import pytest

from megaframe.checkpoint import sharded
from megaframe.optim.rule_registry import RULES, rule_named
from megaframe.parallel.virtual import virtual_mesh
from megaframe.planning.memory.rank_plan import plan_layout
from megaframe.planning.memory.rank_state import optim_bytes_by_dp_rank
from tests.distributed.cases import tiny_config
from tests.distributed.model.test_model_equivalence import assert_weights_close
from tests.distributed.optim.test_zero import SMALL_BUCKETS, rel_errors
from tests.distributed.zero_cases import run_steps
from tests.forms import build_model

pytestmark = pytest.mark.distributed

# (ranks, overrides, HSDP shard size, steps it runs): each link loads the one before under another layout
CHAIN = [
    (2, ["optim.zero=0"], 0, 1),
    (4, ["optim.zero=1"] + SMALL_BUCKETS, 0, 1),
    (4, ["optim.zero=2", "optim.shard_group_size=2"] + SMALL_BUCKETS, 2, 1),
    (2, ["optim.zero=3"], 0, 1),
    (1, ["optim.zero=0"], 0, 2),
]
STEPS = sum(link[3] for link in CHAIN)  # the uninterrupted run the chain continues
OTHER = {"fp32": "bf16", "bf16": "fp32"}
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def planned_per_rank(cfg, n: int) -> list[int]:
    """The planner's optimizer state bytes of each of the n (dp) ranks: the plan's figure (the coordinate's
    most) and, for a rule whose ranks differ (Muon under ZeRO), each dp rank's."""
    planned = plan_layout(cfg, n).ranks[0].optim_bytes
    if not cfg.optim.zero or rule_named(cfg.optim.name).kinds is None:
        return [planned] * n
    by_rank = optim_bytes_by_dp_rank(build_model(cfg, virtual_mesh(1, 1, n)), cfg, 0, 0, n)
    assert planned == max(by_rank)
    return by_rank


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_resumes_across_every_stage_at_its_planned_bytes(pool, tmp_path, rule, dtype):
    ours = [f"optim.name={rule}", f"optim.state_dtype={dtype}"]
    full = pool.run(run_steps, 1, ours + ["optim.zero=0"], STEPS)[0]
    losses, load, at, table = [], None, 0, []
    for i, (n, over, shard, steps) in enumerate(CHAIN):
        last = i == len(CHAIN) - 1
        run = [f"optim.name={rule}", f"optim.state_dtype={OTHER[dtype] if last else dtype}"] + over
        save = None if last else str(tmp_path / str(i))
        got = pool.run(run_steps, n, run, STEPS, load, save, at, at + steps, shard=shard)[0]
        at += steps
        load = f"{save}/step_{at:08d}"
        losses += got["losses"]
        planned = planned_per_rank(tiny_config(run, n), n)
        assert got["optim_bytes_per_rank"] == planned, (run, got["optim_bytes_per_rank"], planned)
        table.append((rule, dtype, over[0], planned))
        if save:
            tensors = sharded.read_metadata(load)["tensors"]
            state = [v["dtype"] for k, v in tensors.items() if k.split("/")[1] in rule_named(rule).states]
            assert set(state) == {TORCH_DTYPE[dtype]}, set(state)
            if "optim.zero=3" in over:  # fp32 ZeRO-3 weights are its master, bit for bit: written once
                assert not [k for k in tensors if k.startswith("optim/master/")]
    assert at == STEPS
    for row in table:
        print("optim bytes per rank, measured = planned:", *row)
    print(f"{rule} {dtype}: max rel loss diff {max(rel_errors(losses, full['losses'])):.2e}")
    assert max(rel_errors(losses, full["losses"])) <= 1e-5, (losses, full["losses"])
    if rule_named(rule).elementwise:
        assert_weights_close(got["weights"], full["weights"])
        return
    # a whole-matrix rule (Muon) orthogonalises in bf16 (torch's Newton-Schulz): a last-bit difference of
    # the summed grads can flip an entry's rounding, a few bf16 ulps (of entries <= 0.5) times the lr a step
    lr = tiny_config([], 1).optim.lr
    atol = STEPS * lr * 2**-6
    for name, want in full["weights"].items():
        diff = (got["weights"][name] - want).abs()
        off = diff > atol + 1e-4 * want.abs()
        # ...and those differences reach the AdamW side (embeddings, norms) through the grads: an element
        # whose grads stay below that noise (a token seldom seen) takes Adam's normalised step, about lr, in
        # a direction set by their last bits. Which elements do depends on the CPU's bf16 matmul kernels; a
        # few of them may differ by up to lr a step, never more, the rest within atol.
        assert off.float().mean() <= 1e-3 and diff.max() <= STEPS * lr, (name, int(off.sum()), diff.max())
