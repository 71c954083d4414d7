"""ZeRO-1 distributed optimizer: equal to one process, equal to zero=0, the dp byte count, the
overlap, layout-free moments, and a bf16 smoke run (checkpoint round trips across stages and the
optimizer memory against the planner: test_update_rules.py)."""

import importlib.util
import math

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close
from tests.distributed.zero_cases import (
    bf16_checkpoint_roundtrip,
    bf16_losses,
    logical_moments,
    overlap_probe,
    pipeline_ends_probe,
    run_steps,
)

pytestmark = pytest.mark.distributed

# three steps: step 1's loss and (reduce-scattered) grads, then two updates from the sharded moments (the
# second reads what the first wrote: state, buckets, the all-gathered params) and the weights after three
STEPS = 3
HAS_PP = importlib.util.find_spec("megaframe.pipeline") is not None
FAMILIES = {"gpt_tiny": [], "gpt2_tiny": ["model=gpt2_tiny", "model.num_query_groups=null"]}
SMALL_BUCKETS = ["optim.bucket_size_mb=0.01"]  # >= 2.6k elements: 5-10 buckets, params straddling ranks
# (name, ranks, tp, pp, overrides)
LAYOUTS = [
    ("dp2", 2, 1, 1, []),
    ("dp4", 4, 1, 1, []),
    ("tp2-dp2-sp", 4, 2, 1, ["parallel.tp=2", "parallel.sp=true"]),
    pytest.param(
        "pp2-dp2", 4, 1, 2, ["parallel.pp=2"], marks=pytest.mark.skipif(not HAS_PP, reason="needs pipeline")
    ),
]
_reference: dict = {}


def reference(pool, family):
    """One process, plain replicated AdamW (zero=0)."""
    if family not in _reference:
        _reference[family] = pool.run(run_steps, 1, FAMILIES[family] + ["optim.zero=0"], STEPS)[0]
    return _reference[family]


def rel_errors(a, b):
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name,n,tp,pp,extra", LAYOUTS)
def test_zero_matches_one_process(pool, family, name, n, tp, pp, extra):
    ref = reference(pool, family)
    got = pool.run(run_steps, n, FAMILIES[family] + SMALL_BUCKETS + extra, STEPS, tp=tp, pp=pp)[0]
    assert got["buckets"] > 4
    assert max(rel_errors(got["losses"], ref["losses"])) <= 1e-5, (got["losses"], ref["losses"])
    # the same tolerances as test_model_equivalence (see there for the weights' atol)
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])


def test_zero0_and_zero1_agree(pool):
    plain = pool.run(run_steps, 2, ["optim.zero=0"], STEPS)[0]
    zero = pool.run(run_steps, 2, ["optim.zero=1"] + SMALL_BUCKETS, STEPS)[0]
    # with 2 dp ranks every sum has two terms, so grads agree to the bit; only the norm's summation
    # order (and so the clip scale) may differ in the last bit
    assert max(rel_errors(zero["losses"], plain["losses"])) <= 1e-6, (zero["losses"], plain["losses"])
    assert_close_dicts(zero["grads"], plain["grads"], rtol=1e-6, atol=1e-8, what="grad")
    assert_close_dicts(zero["weights"], plain["weights"], rtol=1e-5, atol=1e-6, what="weight")


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("buckets", ["one", "many"])
def test_dp_bytes_match_reduce_scatter_plus_all_gather(pool, dp, buckets):
    """Per step on dp, with B = the padded buffer (every bucket padded to a multiple of dp, so B is too):
        reduce-scatter (dp-1)/dp · 4B  +  all-gather (dp-1)/dp · 4B  +  grad-norm scalar 2(dp-1)/dp · 4
    With one bucket B = ceil(N/dp)·dp for N local parameters. Each collective's count is truncated to an
    int separately (< 1 byte each)."""
    over = SMALL_BUCKETS if buckets == "many" else []
    got = pool.run(run_steps, dp, over, 2)[0]
    n, b, nb = got["params_numel"], got["buffer_numel"], got["buckets"]
    if buckets == "one":
        assert nb == 1 and b == math.ceil(n / dp) * dp
    else:
        assert nb > 4 and n <= b < n + nb * dp
    theory = 2 * (dp - 1) / dp * 4 * b + 2 * (dp - 1) / dp * 4
    for sent in got["comm"]:
        assert abs(sent["dp"] - theory) <= 2 * nb + 1, (sent, theory)
        assert sent.get("tp", 0) == 0 and sent.get("pp", 0) == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_reduce_scatter_starts_during_the_last_backward_only(pool, overlap):
    launched = pool.run(overlap_probe, 2, SMALL_BUCKETS, overlap)[0]["launched"]
    assert len(launched) == 2  # 8 samples / (2 per micro-batch x dp 2)
    assert not any(launched[0])  # accumulation step: nothing reduced yet
    assert all(launched[1]) if overlap else not any(launched[1])


@pytest.mark.skipif(not HAS_PP, reason="needs pipeline")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_ends_treated_alike_by_zero0_and_zero1(pool, family):
    """pp2-dp2: the embedding's grads are summed over the pipeline ends only when the embeddings are tied
    (gpt2_tiny), by both optimizers alike. ZeRO then holds back exactly the embedding's bucket on each
    end until that sum is done; with untied embeddings (gpt_tiny) every bucket is reduce-scattered
    during backward. (Before the Placement record ZeRO held back the untied embedding's bucket too,
    reading `hasattr(p, "pp_duplicate")` where zero=0 read its value.)"""
    over = FAMILIES[family] + ["parallel.pp=2"] + SMALL_BUCKETS
    plain = pool.run(pipeline_ends_probe, 4, over + ["optim.zero=0"], pp=2)
    zero = pool.run(pipeline_ends_probe, 4, over + ["optim.zero=1"], pp=2)
    tied = family == "gpt2_tiny"
    for z, p in zip(zero, plain):
        held_back = z["launched"].count(False)
        assert held_back == (1 if tied else 0), (family, z["pp_rank"], z["launched"])
        assert z["sent"].get("pp", 0) == p["sent"].get("pp", 0), (z["sent"], p["sent"])
    assert abs(zero[0]["loss"] - plain[0]["loss"]) <= 1e-6 * abs(plain[0]["loss"])
    assert_close_dicts(zero[0]["grads"], plain[0]["grads"], rtol=1e-6, atol=1e-8, what="grad")


def test_checkpoint_moments_are_layout_free(pool):
    """Adam moments as logical tensors: zero=1 at dp=4 (tiny buckets) equals zero=0 at dp=1."""
    plain = pool.run(logical_moments, 1, ["optim.zero=0"], 3)[0]
    zero = pool.run(logical_moments, 4, SMALL_BUCKETS, 3)[0]
    assert len(zero) == len(plain) > 0
    assert_close_dicts(zero, plain, rtol=1e-4, atol=1e-8, what="moment")


def test_bf16_loss_falls_and_stays_finite(pool):
    got = pool.run(bf16_losses, 2, SMALL_BUCKETS, 8)[0]
    assert got["finite"], got["losses"]
    assert got["losses"][-1] < got["losses"][0] - 0.05, got["losses"]
    assert got["param_dtype"] == "torch.bfloat16"
    assert set(got["state_dtypes"].values()) == {"torch.float32"} and "master" in got["state_dtypes"]
    m = got["mem"]
    # fp32 grad buffer (4 B/element) on every rank; master + two moments (12 B/element) on 1/dp of it
    assert m["mem/optim_bytes"] == pytest.approx(3 * m["mem/grads_bytes"] / 2, rel=1e-6)
    assert m["mem/params_bytes"] == pytest.approx(m["mem/grads_bytes"] / 2, rel=0.01)


def test_bf16_checkpoint_keeps_fp32_master(pool, tmp_path):
    got = pool.run(bf16_checkpoint_roundtrip, 2, ["optim.zero=0"], str(tmp_path))[0]
    # an fp32 resume continues from the exact fp32 master, not from the rounded bf16 params
    assert got["has_master"] and got["err"] == 0.0


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_compiled_step_matches_the_eager_step_under_dp2(pool, zero):
    """optim.step_kernel=compiled under dp2 with bf16 params, bf16 state and bf16-reduced grads (the 22 B per
    param step): zero=1's pass writes each rank's bf16 param range, which the all-gather hands to the other
    rank (zero=2 alike); zero=3's writes the master its gathers read. The losses and weights are the same
    stage's eager step's (torch's fused AdamW, then the cast) to rounding."""
    over = ["train.precision=bf16", "optim.state_dtype=bf16", "optim.grad_reduce_dtype=bf16"] + SMALL_BUCKETS
    over += [f"optim.zero={zero}"]
    eager = pool.run(train_and_report, 2, over, 3)[0]
    compiled = pool.run(train_and_report, 2, over + ["optim.step_kernel=compiled"], 3)[0]
    assert max(rel_errors(compiled["losses"], eager["losses"])) <= 1e-5, (compiled["losses"], eager["losses"])
    # a bf16 weight may round the other way where the fp32 masters differ in their last bit
    assert_close_dicts(compiled["weights"], eager["weights"], rtol=1e-2, atol=1e-5, what="weight")
