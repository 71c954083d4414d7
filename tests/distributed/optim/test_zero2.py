"""ZeRO-2 (grads kept only as this rank's shard) and HSDP (shard groups, replicated across them): equal to
one process, grads memory 1/dp (HSDP: 1/s) of ZeRO-1's, and the dp bytes of every step equal to theory
to the byte (and to the planner's figures); overlapped parameter all-gather (checkpoints across stages:
test_update_rules.py)."""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close
from tests.distributed.optim.test_zero import FAMILIES, HAS_PP, SMALL_BUCKETS, STEPS, reference, rel_errors
from tests.distributed.zero_cases import param_gather_probe, run_steps

pytestmark = pytest.mark.distributed

# (name, ranks, shard group size (0 = dp), pp, overrides)
CASES = [
    ("zero2-dp2", 2, 0, 1, ["optim.zero=2"]),
    ("zero2-dp4", 4, 0, 1, ["optim.zero=2"]),
    ("hsdp-dp4-s2-zero2", 4, 2, 1, ["optim.zero=2", "optim.shard_group_size=2"]),
    ("hsdp-dp4-s2-zero1", 4, 2, 1, ["optim.zero=1", "optim.shard_group_size=2"]),
]


def theory_dp_bytes(bucket_numels: list[int], s: int, dp: int, microbatches: int, zero: int) -> int:
    """Bytes one rank sends on dp in one step, each collective as comm counts it (ring volumes, whole
    bytes). Shard group of s ranks (s = dp without HSDP), r = dp/s replicas, buckets of n_b fp32 elements:
        reduce-scatter per bucket  (s-1)/s · 4 n_b   once per step (zero=1) or per micro-batch (zero=2)
        HSDP all-reduce            2(r-1)/r · 4 Σ n_b / s   (this rank's shard, once per step)
        all-gather per bucket      (s-1) · 4 n_b / s   (fp32 params)
        grad-norm scalar           2(s-1)/s · 4"""
    r = dp // s
    rs = sum((s - 1) * 4 * n // s for n in bucket_numels) * (microbatches if zero == 2 else 1)
    ar = 2 * (r - 1) * 4 * sum(bucket_numels) // s // r if r > 1 else 0
    ag = sum((s - 1) * 4 * n // s for n in bucket_numels)
    norm = int(2 * (s - 1) / s * 4)
    return rs + ar + ag + norm


@pytest.mark.parametrize("name,n,shard,pp,extra", CASES, ids=[c[0] for c in CASES])
def test_zero2_and_hsdp_match_one_process(pool, name, n, shard, pp, extra):
    ref = reference(pool, "gpt_tiny")
    got = pool.run(run_steps, n, SMALL_BUCKETS + extra, STEPS, shard=shard)[0]
    assert got["buckets"] > 4
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
    s, zero = shard or n, int(extra[0].split("=")[1])
    # memory: optimizer state 1/s of the 8 B per element of one process; zero=2 grads 1/s of ZeRO-1's buffer
    m, b = got["mem"], got["buffer_numel"]
    assert m["mem/optim_bytes"] == 8 * b // s
    assert m["mem/grads_bytes"] == (4 * b // s if zero == 2 else 4 * b)
    assert (m["mem/gathered_peak_bytes"] > 0) == (zero == 2)
    assert m["mem/gathered_peak_bytes"] <= 4 * b // 2  # a few buckets at a time, never the whole buffer
    want = theory_dp_bytes(got["bucket_numels"], s, n, got["microbatches"], zero)
    for sent in got["comm"]:
        assert sent["dp"] == want, (sent, want)
    # the planner sizes and counts the same, from the config alone
    planned = plan_layout(tiny_config(SMALL_BUCKETS + extra, n), n).ranks[0]
    assert (planned.grads_bytes, planned.optim_bytes, planned.dp_comm_bytes) == (
        m["mem/grads_bytes"],
        m["mem/optim_bytes"],
        want,
    )


@pytest.mark.skipif(not HAS_PP, reason="needs pipeline")
def test_zero2_tied_embedding_under_pp(pool):
    """pp2-dp2 on gpt2_tiny (tied embeddings): the embedding's bucket keeps its full grad for the step
    (summed over the pipeline ends before its reduce-scatter); every other bucket is sharded."""
    ref = reference(pool, "gpt2_tiny")
    got = pool.run(
        run_steps, 4, FAMILIES["gpt2_tiny"] + SMALL_BUCKETS + ["optim.zero=2", "parallel.pp=2"], STEPS, pp=2
    )[0]
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
    assert got["mem"]["mem/grads_bytes"] < 4 * got["buffer_numel"]


@pytest.mark.parametrize("overlap", [True, False])
def test_param_gather_overlaps_the_next_forward(pool, overlap):
    """optim.overlap_param_gather: step() leaves every bucket's all-gather in flight; the first block's
    pre-hook has waited only for the buckets up to its own (the later layers' still fly); the forward
    ends with none in flight. Off: step() waits for all of them."""
    over = SMALL_BUCKETS + ["optim.zero=2", f"optim.overlap_param_gather={str(overlap).lower()}"]
    got = pool.run(param_gather_probe, 2, over)[0]
    assert got["total"] > 4
    if overlap:
        assert got["after_step"] == got["total"]
        assert 0 < got["first_block"] < got["total"]
    else:
        assert got["after_step"] == got["first_block"] == 0
    assert got["after_forward"] == 0
