"""ZeRO-3 (params sharded too, gathered block by block): equal to one process at dp2 and dp4, params,
grads and optimizer state per rank against the layout, dp bytes to theory to the byte, and a resume
chain zero=3 dp4 -> zero=1 dp2 -> zero=0 one process."""
import pytest

from megaframe.planning.estimate import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.test_model_equivalence import assert_close_dicts
from tests.distributed.test_zero import STEPS, reference, rel_errors
from tests.distributed.zero_cases import run_steps

pytestmark = pytest.mark.distributed


def theory_dp_bytes(bucket_numels: list[int], dp: int, microbatches: int) -> int:
    """One step's bytes on dp (buckets: one per block, the last one the params outside blocks, R):
        block gathers   2 per micro-batch (forward, backward), (dp-1)·4n/dp each
        R's gather      once, after the update
        reduce-scatter  every bucket once per micro-batch, (dp-1)/dp·4n
        grad-norm scalar 2(dp-1)/dp·4"""
    *blocks, resident = bucket_numels
    one = [(dp - 1) * 4 * n // dp for n in bucket_numels]
    return (microbatches * 2 * sum(one[:-1]) + one[-1] + microbatches * sum(one)
            + int(2 * (dp - 1) / dp * 4))


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_matches_one_process(pool, dp):
    ref = reference(pool, "gpt_tiny")
    got = pool.run(run_steps, dp, ["optim.zero=3"], STEPS)[0]
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_close_dicts(got["weights"], ref["weights"], rtol=1e-4, atol=1e-4, what="weight")
    m, b, resident = got["mem"], got["buffer_numel"], got["bucket_numels"][-1]
    assert len(got["bucket_numels"]) == 3  # the two blocks and the params outside them
    # params: this rank's fp32 owned range plus the (whole) params outside blocks; grads and Adam moments 1/dp
    assert m["mem/params_bytes"] == 4 * b // dp + 4 * resident
    assert m["mem/grads_bytes"] == 4 * b // dp and m["mem/optim_bytes"] == 8 * b // dp
    block = max(got["bucket_numels"][:-1])
    assert 4 * block <= m["mem/gathered_peak_bytes"] <= 4 * (2 * block + b), m  # <= 2 blocks + transient grads
    # the last step: steps 1-2 differ only by gathers the test's own full-state reads made unnecessary
    want = theory_dp_bytes(got["bucket_numels"], dp, got["microbatches"])
    assert got["comm"][-1]["dp"] == want
    planned = plan_layout(tiny_config(["optim.zero=3"], dp), dp).ranks[0]  # the planner, from the config alone
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
