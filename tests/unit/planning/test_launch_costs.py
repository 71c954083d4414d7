"""The step time's fixed per-call costs (planning.steptime.launches): launches hidden behind large GPU work,
paid by a small model's short kernels, the MoE dispatcher's host sync per layer forward, none on the cpu."""

from __future__ import annotations

import dataclasses

import pytest

from megaframe.config import load_config
from megaframe.planning.candidate import Layout
from megaframe.planning.devices import DEVICES
from megaframe.planning.steptime import launches as launch
from megaframe.planning.steptime.timing import step_time
from tests.unit.planning.test_plan_search import SMALL

# test_plan_search's small model, in bf16 and at a batch of 128 (many micro-batches of short kernels)
TINY = [o for o in SMALL if not o.startswith("train.global_batch_size")]
TINY += ["train.precision=bf16", "train.global_batch_size=128"]
H100 = DEVICES["H100"]


def _cfg(*extra: str):
    return load_config([*TINY, *extra], world_size=1, check_data=False)


def test_a_small_model_at_large_dp_waits_on_its_launches():
    c = _cfg()
    lay = Layout(1, 1, 1, 64, 1, 3, 1, "none")
    t = step_time(c, lay, H100, 64)
    # 4 blocks x 2 micro-batches, each shorter on the GPU than its kernels' issue time: the step is
    # no shorter than issuing them
    kernels = launch.block_kernels(c.model, False, 0)
    assert t["launch"] > 0
    assert t["compute"] + t["launch"] >= 4 * 2 * kernels * launch.LAUNCH_S
    # compiled: fewer kernels (the elementwise ops fused), less to wait on
    assert launch.block_kernels(c.model, True, 0) < kernels
    assert step_time(_cfg("train.compile=true"), lay, H100, 64)["launch"] < t["launch"]


def test_large_work_per_kernel_hides_the_launches():
    c = _cfg(
        "model.hidden_size=4096",
        "model.ffn_hidden_size=16384",
        "model.num_attention_heads=32",
        "model.seq_length=2048",
        "model.num_query_groups=8",
        "model.vocab_size=32000",
    )
    assert step_time(c, Layout(1, 1, 1, 8, 1, 3, 2, "none"), H100, 8)["launch"] == 0.0


def test_the_cpu_has_no_launch_queue():
    cpu = dataclasses.replace(H100, name="cpu", hbm_bw=0.0)
    assert step_time(_cfg(), Layout(1, 1, 1, 64, 1, 3, 1, "none"), cpu, 64)["launch"] == 0.0


@pytest.mark.parametrize("recompute, forwards", [("none", 1), ("full", 2)])
def test_moe_pays_a_host_sync_per_layer_forward(recompute, forwards):
    moe = ["model.family=mixtral", "model.num_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden_size=64"]
    c = _cfg(*moe, "model.hidden_size=2048", "model.seq_length=2048", "model.num_attention_heads=16")
    t = step_time(c, Layout(1, 1, 1, 8, 1, 1, 1, recompute), H100, 8)
    # 4 MoE layers x 16 micro-batches, each sync at least its round trip and the next launch
    assert t["launch"] >= 4 * 16 * forwards * (launch.SYNC_S + launch.LAUNCH_S)
