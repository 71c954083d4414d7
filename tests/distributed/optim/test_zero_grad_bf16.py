"""optim.grad_reduce_dtype=bf16 (Megatron's --grad-reduce-in-bf16): under bf16 training the ZeRO grad
buffers, their micro-batch accumulation and their reduce-scatters / all-reduces are bf16; the update still
steps the fp32 master weights from an fp32 copy of the reduced owned range.

Against the same bf16 run with fp32 reduction, at zero 1-3 on dp2 and dp4 (and HSDP, and a tied embedding
under pp2): equal to bf16 noise, grad memory and the grads' dp bytes exactly half, and the planner's
figures equal to the measured ones. (zero=0 has no bf16 path: bf16 training needs zero >= 1.)

The bounds, with u = 2^-8 the unit roundoff of bf16 (8 significand bits):
  step-1 grads  per tensor ||g_bf16 - g_fp32|| <= sqrt(k)·u·||g_fp32||, k = dp x micro-batches = the terms
                of the sum: summation in bf16 rounds k-1 partial sums and the result, each by <= u relative;
                over a tensor's elements these roundings are independent, so their norms add in quadrature
                (the worst case of one element, k·u, is not what a whole tensor shows). Every case here
                has k = 4: bound 2u = 7.8e-3, measured <= 3.6e-3 (~0.9u).
  losses        relative difference <= u at every step: the runs agree to bf16's own resolution.
                Measured <= 4e-5 over 6 steps (the test runs STEPS = 3).
A dropped or doubled contribution (a rank, a micro-batch, a stale widen to fp32) moves a grad by ~1/k of
its norm, and even one bucket's grads scaled by 0.99 exceeds the bound: the grad bound is the sharp check
(Adam's update is nearly scale-invariant, so the losses alone would miss it)."""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.optim.test_zero import FAMILIES, HAS_PP, SMALL_BUCKETS
from tests.distributed.zero_cases import run_steps

pytestmark = pytest.mark.distributed

U = 2.0**-8
# three steps: step 1's grads (the sharp check), the losses of two updates from the bf16-reduced grads, and
# the last step's dp bytes (a step like every later one)
STEPS = 3
BF16 = ["train.precision=bf16"] + SMALL_BUCKETS
# (ranks, pp, HSDP shard group size (0: dp), zero, overrides)
CASES = {f"zero{z}-dp{n}": (n, 1, 0, z, []) for z in (1, 2, 3) for n in (2, 4)}
CASES["hsdp-dp4-s2-zero2"] = (4, 1, 2, 2, ["optim.shard_group_size=2"])
if HAS_PP:
    CASES["pp2-dp2-tied-zero2"] = (4, 2, 0, 2, FAMILIES["gpt2_tiny"] + ["parallel.pp=2"])


def grad_reduce_bytes(bucket_numels: list[int], s: int, r: int, microbatches: int, zero: int, g: int) -> int:
    """Bytes one rank sends reducing grads in one step, g bytes an element (no late bucket): each bucket's
    reduce-scatter (s-1)/s·g·n, once a step (zero=1) or per micro-batch (zero>=2), and under HSDP the
    all-reduce of the shard over the r replicas, 2(r-1)/r·g·Σn/s."""
    rs = sum((s - 1) * g * n // s for n in bucket_numels) * (microbatches if zero >= 2 else 1)
    return rs + (2 * (r - 1) * g * sum(bucket_numels) // s // r if r > 1 else 0)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_grad_reduction(pool, name):
    n, pp, shard, zero, extra = CASES[name]
    over = BF16 + [f"optim.zero={zero}"] + extra
    ref = pool.run(run_steps, n, over, STEPS, pp=pp, shard=shard)[0]
    got = pool.run(run_steps, n, over + ["optim.grad_reduce_dtype=bf16"], STEPS, pp=pp, shard=shard)[0]
    dp = n // pp
    k = dp * got["microbatches"]
    worst = 0.0
    for key, g in ref["grads"].items():
        err = (got["grads"][key].float() - g.float()).norm() / g.float().norm()
        assert err <= k**0.5 * U, (key, err.item(), k**0.5 * U)
        worst = max(worst, err.item())
    assert worst > 0  # the bf16 path ran: its rounding shows (fp32 reduction of equal inputs would not)
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= U * abs(b), (got["losses"], ref["losses"])
    # memory: every persistent grad byte (buffer, shard, a tied embedding's kept bucket) halves
    assert 2 * got["mem"]["mem/grads_bytes"] == ref["mem"]["mem/grads_bytes"], (got["mem"], ref["mem"])
    assert got["mem"]["mem/optim_bytes"] == ref["mem"]["mem/optim_bytes"]
    # the update's fp32 copy of the owned range (transient: reduction to next zero_grad), 4 B per owned
    # element
    assert ref["mem"]["mem/grads_fp32_bytes"] == 0
    assert got["mem"]["mem/grads_fp32_bytes"] == 4 * got["buffer_numel"] // (shard or dp)
    # dp bytes: the grads' share halves to the byte; the param all-gathers (bf16 already) and the norm's
    # fp32 scalar do not change
    if pp == 1:
        s = shard or dp
        full = grad_reduce_bytes(got["bucket_numels"], s, dp // s, got["microbatches"], zero, 4)
        assert full == 2 * grad_reduce_bytes(got["bucket_numels"], s, dp // s, got["microbatches"], zero, 2)
        assert ref["comm"][-1]["dp"] - got["comm"][-1]["dp"] == full // 2, (
            ref["comm"][-1],
            got["comm"][-1],
            full,
        )
    # the planner, from the config alone, sizes and counts both the same as the run
    for run, cfg in ((ref, over), (got, over + ["optim.grad_reduce_dtype=bf16"])):
        planned = plan_layout(tiny_config(cfg, n), n).ranks[0]
        assert (planned.grads_bytes, planned.grads_fp32_bytes, planned.dp_comm_bytes) == (
            run["mem"]["mem/grads_bytes"],
            run["mem"]["mem/grads_fp32_bytes"],
            run["comm"][-1]["dp"],
        )
