"""The dry-run planner's command line: the table, the JSON, the DOES NOT FIT flag, exit 2 on a bad
layout, large presets in seconds, and the activation peak against the schedule's own bound."""

import json
import subprocess
import sys
import time

import pytest

from megaframe.config import load_config
from megaframe.pipeline.schedule import activation_bound, compute_order
from megaframe.plan import main, split_args
from megaframe.planning.memory.inflight import peak_activations
from megaframe.planning.memory.rank_plan import plan_layout
from megaframe.planning.render import ranges
from tests.e2e.helpers import ROOT, TINY

LLAMA8B = [
    "model=llama3_8b",
    "data=synthetic",
    "parallel.tp=8",
    "parallel.pp=4",
    "parallel.sp=true",
    "train.micro_batch_size=1",
    "train.global_batch_size=512",
    "train.precision=bf16",
]


def test_split_args_takes_the_planners_own_keys():
    over, own = split_args(["parallel.tp=2", "+world_size=8", "device_memory_gb=80", "+plan_json=x.json"])
    assert over == ["parallel.tp=2"] and own == {
        "world_size": "8",
        "device_memory_gb": "80",
        "plan_json": "x.json",
    }
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_bad_layout_exits_2_with_one_line(capsys):
    assert main(["data=synthetic", "parallel.tp=3", "+world_size=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megaframe: error:") and "parallel.tp" in err and "\n" not in err


def test_json_and_does_not_fit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["data=synthetic", *TINY, "parallel.pp=2", "+world_size=4", f"+plan_json={out}"]
    assert main(args + ["+device_memory_gb=0.0005"]) == 0  # 512 KiB: too small for every rank
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "pipeline bubble" in text
    plan = json.loads(out.read_text())
    assert plan["fits"] is False and plan["layout"]["dp"] == 2 and len(plan["ranks"]) == 2
    assert sorted(r for row in plan["ranks"] for r in row["ranks"]) == [0, 1, 2, 3]
    assert main(args + ["+device_memory_gb=1"]) == 0
    assert "DOES NOT FIT" not in capsys.readouterr().out and json.loads(out.read_text())["fits"] is True


def test_bubble_and_inflight_follow_the_schedule():
    cfg = load_config(
        ["data=synthetic", *TINY, "model.num_layers=4", "parallel.pp=2", "parallel.vpp=2"],
        world_size=2,
        check_data=False,
    )
    plan = plan_layout(cfg, 2)
    m = plan.microbatches
    assert plan.bubble == pytest.approx((2 - 1) / (2 * m + 2 - 1))
    for r in plan.ranks:  # equal chunk sizes: the peak count is the schedule's activation bound
        order = compute_order("interleaved", 2, 2, m, r.pp_rank)
        assert peak_activations(order, [1, 1])[1] == activation_bound("interleaved", 2, 2, m, r.pp_rank)
        assert r.peak_inflight <= activation_bound("interleaved", 2, 2, m, r.pp_rank)


def test_llama3_8b_plans_in_seconds_from_the_command_line():
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "megaframe.plan", *LLAMA8B, "+world_size=256", "+device_memory_gb=80"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    print(res.stdout, f"({elapsed:.1f}s)")
    assert "fits: every rank" in res.stdout and elapsed < 60
    # params on the first stage: 8 of 32 layers + the embedding, split over tp=8, in bf16
    assert "541.38 MiB" in res.stdout


def test_a_phase_over_the_memory_does_not_fit(capsys):
    """Every phase is listed; a layout whose save needs more than the device has does not fit, even though
    its step does (a cpu run: the save's copy of what the rank writes is in the same memory)."""
    over = [
        "data=synthetic",
        "train.device=cpu",
        "optim.zero=0",
        "model.num_layers=2",
        "model.hidden_size=256",
        "model.ffn_hidden_size=512",
        "model.vocab_size=2048",
        "model.seq_length=64",
    ]
    r = plan_layout(load_config(over, world_size=1, check_data=False), 1).ranks[0]
    assert set(r.phases) == {"startup", "step", "save", "load"} and r.phases["save"] > r.phases["step"]
    gib = (r.phases["step"] + r.phases["save"]) / 2 / 2**30  # room for the step, not for the save
    assert main([*over, "+world_size=1", f"+device_memory_gb={gib}"]) == 0
    out = capsys.readouterr().out
    assert "memory per phase" in out and "save" in out and "(largest)" in out
    assert "DOES NOT FIT" in out and "(in save)" in out
    gpu = plan_layout(
        load_config([o for o in over if o != "train.device=cpu"], world_size=1, check_data=False), 1
    )
    assert (
        gpu.ranks[0].phases["save"] < r.phases["save"] and gpu.ranks[0].host_bytes["save"] > 0
    )  # host memory on a GPU


def test_the_planned_head_workspace_follows_the_fused_heads_gpu_chunk():
    """The step phase plans the fused head's chunk of logits; on a GPU the head sizes its chunks by
    layers.fused_ce.CHUNK_ELEMS, so the plan must use the same budget (it once kept an older, 16x smaller
    one)."""
    from megaframe.layers.fused_ce import CHUNK_ELEMS
    from megaframe.planning.memory.phases import HEAD_CHUNK_ELEMS

    assert HEAD_CHUNK_ELEMS["cuda"] == CHUNK_ELEMS["cuda"]


def test_a_compiled_layout_plans_as_its_eager_one_less_the_elementwise_traffic(tmp_path, capsys):
    """train.compile=true plans (it crashed: AOT's partitioner on the meta model's compiled blocks): the
    memory is the eager plan's less the silu output a compiled SwiGLU recomputes (one [S, B, F] per layer
    and micro-batch), the state to the byte; the step time differs only in the elementwise part."""
    plans = {}
    for flag in ("false", "true"):
        out = tmp_path / f"{flag}.json"
        args = ["data=synthetic", *TINY, "parallel.pp=2", "+world_size=4", "+device=H100"]
        args.append(f"+plan_json={out}")
        assert main([*args, f"train.compile={flag}"]) == 0
        plans[flag] = json.loads(out.read_text())
    capsys.readouterr()
    eager, compiled = plans["false"], plans["true"]
    silu = 2 * 32 * 128 * 4  # TINY: micro-batch 2 x seq 32 x ffn 128, fp32; one layer a stage
    for c, e in zip(compiled["ranks"], eager["ranks"]):
        assert c["chunk_activation_bytes"] == [b - silu for b in e["chunk_activation_bytes"]]
        assert [c[k] for k in ("params_bytes", "grads_bytes", "optim_bytes")] == [
            e[k] for k in ("params_bytes", "grads_bytes", "optim_bytes")
        ]
    assert compiled["peak_bytes"] < eager["peak_bytes"]
    differ = {k for k, v in compiled["step_parts_s"].items() if v != eager["step_parts_s"][k]}
    assert compiled["step_parts_s"]["compute"] < eager["step_parts_s"]["compute"]
    # what the compute shifts (and the launches: compiled, fewer kernels); the collectives are the same
    assert differ <= {"compute", "launch", "bubble", "dp"}
