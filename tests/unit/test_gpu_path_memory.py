"""Small GPU-path defects, checked on CPU: sp saves the local sequence block for backward, the fused
head accumulates its weight grad in fp32 under bf16, and H100 PCIe/NVL get their own peaks."""

import math

import torch
import torch.nn.functional as F

from megaframe.config import load_config
from megaframe.layers.fused_ce import linear_cross_entropy
from megaframe.layers.linear import ColumnParallelLinear
from megaframe.parallel.virtual import virtual_mesh
from megaframe.planning.memory.activations import saved_bytes
from megaframe.training.metrics import gpu_peak
from tests.forms import build_model


def test_sp_column_parallel_saves_only_the_local_sequence_block():
    """Megatron's sp: the input is all-gathered for the GEMM but saved (and re-gathered in backward) as
    this rank's S/tp block; the old path kept the gathered [S, B, I] for backward."""
    tp, s, b, i = 4, 16, 2, 8
    mesh = virtual_mesh(tp, 1, 1, device="meta")
    layer = ColumnParallelLinear(i, [12], mesh.tp, sp=True, bias=True, device="meta")
    x_SBI = torch.empty(s // tp, b, i, device="meta", requires_grad=True)
    assert saved_bytes(lambda: layer(x_SBI), layer.parameters()) == x_SBI.nbytes


def test_sp_block_saves_no_full_sequence_hidden_state():
    """Under sp every saved [*, B, D] hidden state of a block is an S/tp block: with the gathered input
    saved, qkv and up_proj each kept one [S, B, D] (the planner's llama3_8b tp8 s=8192 figure per
    layer falls from 342.1 to 230.1 MiB, 2 x (64 - 8) MiB)."""
    s, b, d, tp = 32, 2, 64, 4
    over = [
        "data=synthetic",
        "model.num_layers=1",
        f"model.hidden_size={d}",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "model.ffn_hidden_size=192",
        f"model.seq_length={s}",
        f"parallel.tp={tp}",
        "parallel.sp=true",
    ]
    cfg = load_config(over, world_size=tp, check_data=False)
    model = build_model(cfg, virtual_mesh(tp, 1, 1, device="meta"))
    shapes, params = [], {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t):
        if (
            t.untyped_storage()._cdata not in params
        ):  # weights (and their transposed views) are not activations
            shapes.append(tuple(t.shape))
        return t

    x_SBD = torch.empty(s // tp, b, d, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x_SBD, model.rope)
    # D-wide saved tensors, as [S, B, D] or flattened [S·B, D] (F.linear saves its input 2-D)
    hidden = [sh for sh in shapes if sh[-1] == d]
    assert hidden and all(math.prod(sh) == s // tp * b * d for sh in hidden), str(hidden)


def _head_grads(dtype, n=8192, d=64, v=4096):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.05
    t = torch.randint(0, v, (n, 1), generator=g)
    x_, w_ = x.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True)
    linear_cross_entropy(x_, w_, t).sum().backward()
    return w_.grad.float(), x, w, t


def test_fused_head_accumulates_its_weight_grad_in_fp32_under_bf16():
    """16 chunks of 512 tokens (CPU chunking): a bf16 running sum rounds 16 times; fp32 once."""
    got, x, w, t = _head_grads(torch.bfloat16)
    w_ref = w.to(torch.bfloat16).double().requires_grad_(True)
    F.cross_entropy(
        (x.to(torch.bfloat16).double() @ w_ref.t()).flatten(0, 1), t.flatten(), reduction="sum"
    ).backward()
    ref = w_ref.grad.float()
    rel = ((got - ref).norm() / ref.norm()).item()
    # one bf16 rounding of the result is ~2^-9 relative;
    # per-chunk rounding of a running sum is several times that
    assert rel < 4e-3, rel


def test_h100_pcie_and_nvl_peaks_are_not_the_sxm_figure():
    assert gpu_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak("NVIDIA H100 NVL") == 835e12
    assert gpu_peak("NVIDIA H200") == 989e12 and gpu_peak("NVIDIA GH200 480GB") == 989e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB") == 312e12 and gpu_peak("Quadro RTX 8000") == 0.0
