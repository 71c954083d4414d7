"""ZeRO-3 under train.precision=fp8 (tensorwise) all-gathers the float8 linears' weights as float8: 1 byte per
element on the wire where bf16 moves 2, their scales from one all-reduce(max) per step; the run trains like
the bf16 one (loss within 2 %) and like the fp8 one-process run (to fp32 noise: the same float8 weights)."""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.float8_gather_cases import gather_probe
from tests.distributed.zero_cases import run_steps

pytestmark = pytest.mark.distributed

STEPS = 4
# one micro-batch per rank at dp2 (batch 4, micro-batch 2): every collective of a step fits the ring buffer
BASE = ["train.global_batch_size=4", "optim.zero=3"]
# the head float8 too (opt-in), so its weight is gathered as float8 as well
FP8 = ["train.precision=fp8", "train.fp8_head=true"]


def _gathers(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e["op"] == "all_gather_flat" and e["group"] == "dp"]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_runs: list = []  # the three runs, made once for both tests (the pool fixture is per test)


@pytest.fixture
def runs(pool):
    if not _runs:
        _runs.append(pool.run(gather_probe, 2, BASE + FP8, STEPS)[0])
        _runs.append(pool.run(gather_probe, 2, BASE + ["train.precision=bf16"], STEPS)[0])
        # zero=2: its grads take ZeRO-3's path (autograd's bf16 grad, then the hook); zero=1's linears, head
        # and embedding write theirs into the fp32 buffer, unrounded (layers/wgrad.py): not the same sums
        one = ["train.global_batch_size=4", "optim.zero=2", *FP8]
        _runs.append(pool.run(gather_probe, 1, one, STEPS)[0])
    return _runs


def test_float8_weights_gather_one_byte_per_element(runs):
    fp8, bf16, _ = runs
    # the block linears (qkv, out, up, down: 4 a block, 2 blocks) and the untied head: every weight fits
    assert fp8["float8_params"] == 4 * 2 + 1 and sum(fp8["float8_buckets"]) == fp8["float8_numel"]
    f8 = [e for e in _gathers(fp8["step1"]) if e["dtype"] == "torch.uint8"]
    # dp2: a gather sends its shard once; the float8 buckets gathered for forward and again for backward
    assert all(e["bytes"] == _numel(e["shape"]) for e in f8), f8
    assert sum(_numel(e["shape"]) for e in f8) == 2 * fp8["float8_numel"] // 2
    rest = [e for e in _gathers(fp8["step1"]) if e["dtype"] != "torch.uint8"]
    assert rest and all(e["bytes"] == 2 * _numel(e["shape"]) for e in rest), rest  # norms, embedding: bf16
    assert all(e["bytes"] == 2 * _numel(e["shape"]) for e in _gathers(bf16["step1"]))
    # the same elements gathered, the float8 weights' at one byte less each
    moved = [sum(_numel(e["shape"]) for e in _gathers(r["step1"])) for r in (fp8, bf16)]
    assert moved[0] == moved[1]
    total = [sum(e["bytes"] for e in _gathers(r["step1"])) for r in (fp8, bf16)]
    assert total[1] - total[0] == fp8["float8_numel"], total
    # the scales: one all-reduce(max) of every float8 weight's shard amax together, per step
    scales = [e for e in fp8["step1"] if e["op"] == "all_reduce" and e["shape"] == (fp8["float8_params"],)]
    assert len(scales) == 1, [e for e in fp8["step1"] if e["op"] == "all_reduce"]


def test_float8_gather_trains_like_bf16_and_one_process(runs):
    fp8, bf16, one = runs
    for a, b in zip(fp8["losses"], bf16["losses"]):
        assert abs(a - b) / b < 0.02, (fp8["losses"], bf16["losses"])
    # the gathered float8 weight is the one the unsharded run casts (same amax, same bf16 values): the runs
    # differ by the dp reduction's fp32 rounding only (measured: equal)
    for a, b in zip(fp8["losses"], one["losses"]):
        assert abs(a - b) / b < 1e-5, (fp8["losses"], one["losses"])
    assert fp8["losses"] != bf16["losses"]  # float8 GEMMs ran


def test_float8_gather_resumes_exactly(pool, tmp_path, runs):
    """A checkpoint load writes the master: the float8 weights' scales are recomputed before the next gather,
    so steps 3-4 after a resume from step 2 are the unbroken run's."""
    over = BASE + FP8
    pool.run(run_steps, 2, over, STEPS, None, str(tmp_path), 0, 2)
    resumed = pool.run(run_steps, 2, over, STEPS, str(tmp_path / "step_00000002"), None, 2)[0]
    assert resumed["losses"] == runs[0]["losses"][2:], (resumed["losses"], runs[0]["losses"])


def test_planner_counts_the_float8_gather(pool):
    """The planner, from the config alone, counts the run's dp bytes (float8 buckets at 1 byte an element, the
    scales' all-reduce) and its grad and optimizer bytes (the split buckets' layout)."""
    over = BASE + FP8
    run = pool.run(run_steps, 2, over, 2)[0]
    planned = plan_layout(tiny_config(over, 2), 2).ranks[0]
    # step 1's: run_steps gathers every param (bf16) after it to read the grads, so step 2 finds the bf16
    # buckets already gathered
    assert (planned.dp_comm_bytes, planned.grads_bytes, planned.optim_bytes) == (
        run["comm"][0]["dp"],
        run["mem"]["mem/grads_bytes"],
        run["mem"]["mem/optim_bytes"],
    )
