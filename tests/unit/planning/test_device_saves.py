"""What the planner counts as a GPU run's saved activations where its kernels differ from the CPU composite
ops the meta device runs: RMSNorm's fused kernel keeps its input and the per-row reciprocal RMS (the
composite, two fp32 copies of the input), a compiled block's SwiGLU keeps [gate | up] and recomputes the
silu; and a rank fits only with the allocator's headroom over its allocated peak."""

import json

import pytest
import torch
import torch.nn.functional as F

from megaframe.config import load_config
from megaframe.plan import main
from megaframe.planning.memory.activations import FusedAttentionSizes, count_saved
from megaframe.planning.memory.rank_plan import plan_layout
from tests.e2e.helpers import TINY

ROWS, D, FFN = 16, 32, 48


def _saved(fn, params, **kernels) -> int:
    with FusedAttentionSizes(**kernels), count_saved(params) as c:
        fn()
    return c.bytes


def test_fused_rms_norm_keeps_its_input_and_the_row_rstd():
    x = torch.empty(ROWS, 1, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(D, dtype=torch.bfloat16, device="meta", requires_grad=True)

    def norm():
        return F.rms_norm(x * 1, (D,), w, 1e-5)

    # the composite meta runs: two fp32 copies of the input (4x its bf16 bytes), as a CPU run holds
    assert _saved(norm, [w]) == 4 * ROWS * D * 2 + ROWS * 4
    assert _saved(norm, [w], fused_norm=True) == ROWS * D * 2 + ROWS * 4


def test_a_compiled_swiglu_keeps_the_projection_not_the_silu():
    x = torch.empty(ROWS, 1, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(2 * FFN, D, dtype=torch.bfloat16, device="meta", requires_grad=True)

    def swiglu():
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    x_bytes, gate_up, silu = ROWS * D * 2, ROWS * 2 * FFN * 2, ROWS * FFN * 2
    assert _saved(swiglu, [w]) == x_bytes + gate_up + silu  # eager: the silu output too
    assert _saved(swiglu, [w], compiled=True) == x_bytes + gate_up


@pytest.mark.parametrize("headroom", [0.0, 0.5])
def test_a_rank_fits_with_the_allocators_headroom(headroom):
    cfg = load_config(["data=synthetic", *TINY], world_size=1, check_data=False)
    peak = plan_layout(cfg, 1).ranks[0].peak_bytes
    # device memory between the allocated peak and the peak with a 50 % headroom
    plan = plan_layout(cfg, 1, 1.25 * peak / 2**30, headroom)
    assert plan.fits is (headroom == 0.0)


def test_the_command_plans_an_auto_device_as_the_gpu_it_names(tmp_path, capsys):
    """train.device=auto: plan_layout alone plans what this (CPU) host would run, `python -m megaframe.plan
    +device=H100` what that GPU runs (the fused RMSNorm's saves), the same as train.device=cuda."""
    out, base = tmp_path / "plan.json", ["data=synthetic", *TINY]
    assert main([*base, "+world_size=1", "+device=H100", f"+plan_json={out}"]) == 0
    capsys.readouterr()
    planned = json.loads(out.read_text())["ranks"][0]["chunk_activation_bytes"]

    def chunks(*over: str) -> list[int]:
        cfg = load_config([*base, *over], world_size=1, check_data=False)
        return plan_layout(cfg, 1).ranks[0].chunk_activation_bytes

    assert planned == chunks("train.device=cuda") and chunks() == chunks("train.device=cpu") != planned
