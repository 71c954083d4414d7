"""ZeRO-3 (params sharded too, gathered block by block): equal to one process at dp2, dp4, tp2·dp2·sp
and HSDP dp4/s2, params,
grads and optimizer state per rank against the layout, dp bytes to theory to the byte, and a resume
chain zero=3 dp4 -> zero=1 dp2 -> zero=0 one process."""
import pytest

from megaframe.planning.estimate import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.test_model_equivalence import assert_close_dicts
from tests.distributed.test_zero import STEPS, reference, rel_errors
from tests.distributed.zero_cases import run_steps

pytestmark = pytest.mark.distributed


def theory_dp_bytes(bucket_numels: list[int], s: int, r: int, microbatches: int) -> int:
    """One step's bytes on dp, over shard groups of s ranks and r replicas of them (HSDP; r = 1 without),
    with one bucket per block and the last one, R, the params outside blocks:
        block gathers    2 per micro-batch (forward, backward), (s-1)·4n/s each
        R's gather       once, after the update
        reduce-scatter   every bucket once per micro-batch, (s-1)/s·4n
        HSDP all-reduce  the shard, 2(r-1)/r·4·Σn/s, once
        grad-norm scalar 2(s-1)/s·4"""
    one = [(s - 1) * 4 * n // s for n in bucket_numels]
    hsdp = 2 * (r - 1) * 4 * sum(bucket_numels) // s // r
    return (microbatches * 2 * sum(one[:-1]) + one[-1] + microbatches * sum(one) + hsdp
            + int(2 * (s - 1) / s * 4))


# (name, ranks, tp, HSDP shard group size (0: dp), overrides)
CASES = [("dp2", 2, 1, 0, []), ("dp4", 4, 1, 0, []),
         ("tp2-dp2-sp", 4, 2, 0, ["parallel.tp=2", "parallel.sp=true"]),
         ("hsdp-dp4-s2", 4, 1, 2, ["optim.shard_group_size=2"])]


@pytest.mark.parametrize("name,n,tp,shard,extra", CASES, ids=[c[0] for c in CASES])
def test_zero3_matches_one_process(pool, name, n, tp, shard, extra):
    ref = reference(pool, "gpt_tiny")
    over = ["optim.zero=3"] + extra
    got = pool.run(run_steps, n, over, STEPS, tp=tp, shard=shard)[0]
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_close_dicts(got["weights"], ref["weights"], rtol=1e-4, atol=1e-4, what="weight")
    dp = n // tp
    s = shard or dp
    m, b, resident = got["mem"], got["buffer_numel"], got["bucket_numels"][-1]
    assert len(got["bucket_numels"]) == 3  # the two blocks and the params outside them
    # params: this rank's fp32 owned range plus the (whole) params outside blocks; grads and Adam moments 1/s
    assert m["mem/params_bytes"] == 4 * b // s + 4 * resident
    assert m["mem/grads_bytes"] == 4 * b // s and m["mem/optim_bytes"] == 8 * b // s
    block = max(got["bucket_numels"][:-1])
    assert 4 * block <= m["mem/gathered_peak_bytes"] <= 4 * (2 * block + b), m  # <= 2 blocks + transient grads
    # the last step: steps 1-2 differ only by gathers the test's own full-state reads made unnecessary
    want = theory_dp_bytes(got["bucket_numels"], s, dp // s, got["microbatches"])
    assert got["comm"][-1]["dp"] == want
    planned = plan_layout(tiny_config(over, n), n).ranks[0]  # the planner, from the config alone
    assert (planned.params_bytes, planned.grads_bytes, planned.optim_bytes, planned.dp_comm_bytes) == \
        (m["mem/params_bytes"], m["mem/grads_bytes"], m["mem/optim_bytes"], want)


def test_checkpoint_resumes_from_zero3(pool, tmp_path):
    """zero=3 at dp4 for steps 1-2 -> zero=1 at dp2 for 3-4 -> zero=0 in one process for 5-6: the
    losses continue those of one uninterrupted run (<= 1e-5), and so do the final weights."""
    full = reference(pool, "gpt_tiny")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    pool.run(run_steps, 4, ["optim.zero=3"], STEPS, None, a, 0, 2)
    mid = pool.run(run_steps, 2, ["optim.zero=1", "optim.bucket_size_mb=0.01"], STEPS, f"{a}/step_00000002", b, 2, 4)[0]
    end = pool.run(run_steps, 1, ["optim.zero=0"], STEPS, f"{b}/step_00000004", None, 4)[0]
    resumed = mid["losses"] + end["losses"]
    assert max(rel_errors(resumed, full["losses"][2:])) <= 1e-5, (resumed, full["losses"])
    assert_close_dicts(end["weights"], full["weights"], rtol=1e-4, atol=1e-4, what="weight")
