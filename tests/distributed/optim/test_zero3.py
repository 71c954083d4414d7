"""ZeRO-3 (params sharded too, gathered block by block): equal to one process at dp2, dp4, tp2·dp2·sp HSDP
dp4/s2, pp2, pp2 with tied embeddings (gpt2) without resharding after forward, dp4 tied, pp2·vpp2, ep2; params
(a quarter of one process on each of 4 ranks: every param sharded), grads and optimizer state per rank against
the layout, dp bytes to theory to the byte, and a resume chain zero=3 dp4 -> zero=1 dp2 -> zero=0 one process.
"""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.ckpt_cases import load_and_report, zero3_freed_load_steps
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close
from tests.distributed.optim.test_zero import FAMILIES, STEPS, reference, rel_errors
from tests.distributed.zero_cases import bf16_losses, run_steps, save_gather_probe

pytestmark = pytest.mark.distributed


def theory_dp_bytes(
    bucket_numels: list[int],
    uses: list[list[bool]],
    s: int,
    r: int,
    microbatches: int,
    reshard: bool = True,
    late: list[bool] | None = None,
) -> int:
    """One step's bytes on dp, over shard groups of s ranks and r replicas of them (HSDP; r = 1 without),
    with one bucket per gather unit (input step, block, output step; a tied embedding's own):
        gathers          per micro-batch, one per forward use and one per backward use (the input step's
                         backward reads no weights; a tied embedding in one process is read by the input
                         and the output step); once a step without reshard; (s-1)·4n/s each
        reduce-scatter   every bucket once per micro-batch, (s-1)/s·4n (once a step when it holds a tied
                         embedding under pp: `late`, summed over the pipeline ends first)
        HSDP all-reduce  the shard, 2(r-1)/r·4·Σn/s, once
        grad-norm scalar 2(s-1)/s·4"""
    late = late or [False] * len(bucket_numels)
    total = 0
    for n, u, lt in zip(bucket_numels, uses, late):
        one = (s - 1) * 4 * n // s
        gathers = microbatches * sum(1 + bwd for bwd in u) if reshard and u else 1
        total += gathers * one + (1 if lt else microbatches) * one
    hsdp = 2 * (r - 1) * 4 * sum(bucket_numels) // s // r
    return total + hsdp + int(2 * (s - 1) / s * 4)


def assert_quarter_share(got: dict, ref: dict, tied_pp: bool = False) -> None:
    """Every one of the 4 ranks holds a quarter of one process's param bytes (mem/params_bytes), to
    within 0.01: nothing kept whole (the embedding, head and final norm used to be: 0.51 at dp4). A tied
    embedding under pp has a copy on each pipeline end (as in Megatron): the layout holds it twice."""
    whole = ref["mem"]["mem/params_bytes"] + (4 * ref["weights"]["embed.weight"].numel() if tied_pp else 0)
    share = [b / whole for b in got["params_bytes_per_rank"]]
    assert len(share) == 4 and all(abs(x - 0.25) <= 0.01 for x in share), share


# the resume tests save after step 2 of STEPS (3): the last step's loss reads the loaded weights, its update
# the loaded state and the schedule's place
RESUME_AT = 2
G2 = FAMILIES["gpt2_tiny"]
NO_RESHARD = "optim.reshard_after_forward=false"
# (name, family, ranks, tp, pp, HSDP shard group size (0: dp), overrides)
CASES = [
    ("dp2", "gpt_tiny", 2, 1, 1, 0, []),
    ("dp4", "gpt_tiny", 4, 1, 1, 0, []),
    ("dp2-recompute-full", "gpt_tiny", 2, 1, 1, 0, ["train.recompute=full"]),
    ("tp2-dp2-sp", "gpt_tiny", 4, 2, 1, 0, ["parallel.tp=2", "parallel.sp=true"]),
    ("hsdp-dp4-s2", "gpt_tiny", 4, 1, 1, 2, ["optim.shard_group_size=2"]),
    ("pp2-dp2", "gpt_tiny", 4, 1, 2, 0, ["parallel.pp=2"]),
    ("pp2-dp2-tied-keep", "gpt2_tiny", 4, 1, 2, 0, G2 + ["parallel.pp=2", NO_RESHARD]),
    # one process's tied embedding: one bucket read by the input and the output step (3 gathers)
    ("dp4-tied", "gpt2_tiny", 4, 1, 1, 0, G2),
]


@pytest.mark.parametrize("name,family,n,tp,pp,shard,extra", CASES, ids=[c[0] for c in CASES])
def test_zero3_matches_one_process(pool, name, family, n, tp, pp, shard, extra):
    ref = reference(pool, family)
    over = ["optim.zero=3"] + extra
    got = pool.run(run_steps, n, over, STEPS, tp=tp, pp=pp, shard=shard)[0]
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
    dp = n // (tp * pp)
    s = shard or dp
    m, b, numels = got["mem"], got["buffer_numel"], got["bucket_numels"]
    # a bucket per gather unit (input step, blocks, output step; a tied embedding's own), none kept whole
    assert all(got["bucket_uses"]) and len(numels) == len(got["bucket_uses"])
    assert m["mem/params_bytes"] == 4 * b // s  # this rank's fp32 owned range: every param sharded
    late = got["bucket_late"]
    assert sum(late) == (family == "gpt2_tiny" and pp > 1), late  # a tied embedding under pp: its own bucket
    # ... whose grads are kept whole for the step (summed over the pipeline ends first)
    assert m["mem/grads_bytes"] == 4 * b // s + 4 * sum(x for x, lt in zip(numels, late) if lt)
    assert m["mem/optim_bytes"] == 8 * b // s
    block = max(numels)
    assert 4 * block <= m["mem/gathered_peak_bytes"] <= 4 * (2 * block + b), m  # <= 2 units + transient grads
    # the last step: steps 1-2 differ only by gathers the test's own full-state reads made unnecessary
    want = theory_dp_bytes(
        numels, got["bucket_uses"], s, dp // s, got["microbatches"], NO_RESHARD not in extra, late
    )
    assert got["comm"][-1]["dp"] == want
    if n == 4 and not shard:  # (HSDP shards over its group of 2: a half)
        assert_quarter_share(got, ref, tied_pp=sum(late) > 0)
    planned = plan_layout(tiny_config(over, n), n).ranks[0]  # the planner, from the config alone
    assert (planned.params_bytes, planned.grads_bytes, planned.optim_bytes, planned.dp_comm_bytes) == (
        m["mem/params_bytes"],
        m["mem/grads_bytes"],
        m["mem/optim_bytes"],
        want,
    )


def test_zero3_save_gathers_nothing(pool, tmp_path):
    """A zero=3 save writes each rank's owned segments: no param is gathered for it (before, every block
    was gathered at once: the whole local model) and nothing is sent on dp, while a step gathers block
    by block; the checkpoint loads into one process with the weights the run had."""
    got = pool.run(save_gather_probe, 4, ["optim.zero=3"], str(tmp_path))[0]
    assert got["steps"] > 0 and got["save"] == 0 and got["save_dp_bytes"] == 0, got
    back = pool.run(run_steps, 1, ["optim.zero=0"], STEPS, str(tmp_path / "step_00000002"), None, 2, 2)[0]
    assert_close_dicts(back["weights"], got["weights"], rtol=0, atol=0, what="weight")


def test_zero3_interleaved_pipeline(pool):
    """pp2·vpp2 (two chunks of one block per rank, micro-batches interleaved): equal to one process."""
    over = ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"]
    ref = pool.run(run_steps, 1, ["model.num_layers=4", "optim.zero=0"], STEPS)[0]
    got = pool.run(run_steps, 4, over + ["optim.zero=3"], STEPS, pp=2)[0]
    assert_quarter_share(got, ref)
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])


def test_zero3_moe_ep2(pool):
    """moe_tiny at dp4·ep2: dense block params sharded over dp (4), expert params over edp (2), in
    buckets of their own per block; equal to one process."""
    ref = pool.run(run_steps, 1, ["model=moe_tiny", "optim.zero=0"], STEPS)[0]
    got = pool.run(run_steps, 4, ["model=moe_tiny", "parallel.ep=2", "optim.zero=3"], STEPS, ep=2)[0]
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
    assert got["buckets"] == 6  # dense: input step, 2 blocks, output step; experts: 2 blocks
    assert_quarter_share(got, ref)


def test_checkpoint_loads_into_zero3(pool, tmp_path):
    """The other way: zero=1 at dp2 for steps 1-2, then zero=3 at dp4 (pp2) for the last (STEPS = 3),
    losses continuing."""
    full = reference(pool, "gpt_tiny")
    pool.run(run_steps, 2, ["optim.zero=1"], STEPS, None, str(tmp_path), 0, RESUME_AT)
    path = str(tmp_path / f"step_{RESUME_AT:08d}")
    got = pool.run(run_steps, 4, ["optim.zero=3", "parallel.pp=2"], STEPS, path, None, RESUME_AT, pp=2)[0]
    assert max(rel_errors(got["losses"], full["losses"][RESUME_AT:])) <= 1e-5, (got["losses"], full["losses"])
    assert_weights_close(got["weights"], full["weights"])


@pytest.mark.parametrize("source", [1, 3])
def test_checkpoint_loads_into_freed_zero3_blocks(pool, tmp_path, source):
    """Blocks not gathered at load (freed): each rank reads its own segments of the weights (a zero=1
    checkpoint: no master) or of the saved master (zero=3) straight into its master, and the next gathers
    carry them: the losses continue, and a rank reads less than a load into gathered blocks, which reads every
    block whole."""
    full = reference(pool, "gpt_tiny")
    pool.run(run_steps, 2, [f"optim.zero={source}"], STEPS, None, str(tmp_path), 0, RESUME_AT)
    path = str(tmp_path / f"step_{RESUME_AT:08d}")
    got = pool.run(zero3_freed_load_steps, 2, ["optim.zero=3"], STEPS, path, RESUME_AT)
    losses = got[0]["losses"]
    assert max(rel_errors(losses, full["losses"][RESUME_AT:])) <= 1e-5, (losses, full["losses"])
    whole = pool.run(load_and_report, 2, ["optim.zero=3"], path)
    print(
        f"\nzero={source} checkpoint into zero=3 dp2: bytes needed per rank, blocks freed "
        f"{[r['needed_bytes'] for r in got]}, gathered {[r['needed_bytes'] for r in whole]}"
    )
    assert all(r["needed_bytes"] < w["needed_bytes"] for r, w in zip(got, whole))


def test_zero3_bf16_equals_zero2(pool):
    """bf16 params, fp32 master: zero=3 (gathers of bf16 blocks cast from the master) gives zero=2's
    losses exactly, and they fall."""
    z2 = pool.run(bf16_losses, 2, ["optim.zero=2"], 8)[0]
    z3 = pool.run(bf16_losses, 2, ["optim.zero=3"], 8)[0]
    assert z3["finite"] and z3["losses"] == z2["losses"], (z3["losses"], z2["losses"])
    assert z3["losses"][-1] < z3["losses"][0] - 0.05
    assert z3["param_dtype"] == "torch.bfloat16" and "master" in z3["state_dtypes"]
