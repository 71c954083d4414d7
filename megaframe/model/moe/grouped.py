"""All local experts' GEMMs at once: one grouped matmul per projection, no Python loop over experts.

Legend: N rows routed to this rank's experts (grouped by local expert), L local experts, D hidden,
F expert width, M the largest group's rows (padded path).

`torch._grouped_mm(x_ND, w_LDO, offs=offs_L)` multiplies each row block (ending at offs_L[l]) by its
expert's weight in one kernel: CUTLASS grouped GEMM on Hopper (bf16), a native kernel on CPU. Where the
backend has none (CUDA before sm90, fp32 on CUDA), the rows are scattered into an [L, M, D] zero-padded
batch and multiplied by one bmm. Both paths are exact against the per-expert loop (the tests hold them to
it bit for bit on CPU); both take the group ends on the device, so neither adds a host sync.

The router's combine weights are applied here, inside the expert (Megatron's weighted SwiGLU,
`moe_apply_probs_on_input=False` with probs in the activation), not on the expert's output: the down
projection is linear, so down(w·h) = w·down(h), and `_WeightedSwiGLU` keeps only what it already needs,
[gate | up] and the weight per row (4 bytes), recomputing silu in backward. The weight's grad there,
sum_F(dh·silu(gate)·up), needs no [rows, D] expert output saved; weighting the output instead would keep
it (for that grad), and the combine's index_add would keep the weighted copy too: two [rows, D] copies.
So the experts' input rows are the one [rows, D] tensor an MoE layer keeps per routed row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_supported(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs for x's device and dtype (CPU: any float, bf16 alone under
    torch.compile; CUDA: bf16 on sm90+). On meta (the planner) too, as `_MetaGroupedMM`: what the CPU and
    H100 kernels save (the rows and the group ends), where the padded path would save the padded batch and
    its indices."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        # the fake kernel dynamo traces with allows bf16 alone (torch/_meta_registrations.py), where the
        # CPU kernel takes any float: an fp32 MoE under train.compile=true failed to trace
        return x.dtype == torch.bfloat16
    if x.device.type in ("cpu", "meta"):
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


class _MetaGroupedMM(torch.autograd.Function):
    """Shape-only grouped GEMM for the planner's meta forward: saves what torch._grouped_mm's autograd
    saves (the rows, the weight, the group ends). torch's own meta kernel holds every dtype to CUDA's
    bf16 rule, which an fp32 plan (of a CPU run) would break."""

    @staticmethod
    def forward(ctx, x_ND, w_LOI, offs_L):
        ctx.save_for_backward(x_ND, w_LOI, offs_L)
        return x_ND.new_empty((x_ND.shape[0], w_LOI.shape[1]))

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - planning never runs backward
        raise RuntimeError("the planner's grouped GEMM stand-in has no backward")


def meta_grouped_mm(x_ND: torch.Tensor, w_LOI: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """`_MetaGroupedMM`, seen by torch function modes as one op (as torch._grouped_mm is on a device):
    the planner's recorder of weighted ops' inputs (planning.memory.activations) counts it."""
    args = (x_ND, w_LOI, offs_L)
    if torch.overrides.has_torch_function(args):
        return torch.overrides.handle_torch_function(meta_grouped_mm, args, *args)
    return _MetaGroupedMM.apply(*args)


def _group_mm(x_ND: torch.Tensor, w_LOI: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    if x_ND.is_meta:
        return meta_grouped_mm(x_ND, w_LOI, offs_L)
    return torch._grouped_mm(x_ND, w_LOI.transpose(-2, -1), offs=offs_L)


def _padded_mm(x_ND: torch.Tensor, w_LOI: torch.Tensor, where: tuple, m: int) -> torch.Tensor:
    """Rows scattered to [L, M, I] (zero padding), one bmm, the rows gathered back: y_NO."""
    l_N, pos_N = where
    x_LMI = x_ND.new_zeros(w_LOI.shape[0], m, x_ND.shape[-1]).index_put((l_N, pos_N), x_ND)
    return torch.bmm(x_LMI, w_LOI.transpose(-2, -1))[l_N, pos_N]


def _rows_where(offs_L: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, position within its group) of each of the n rows, from the group ends on the device."""
    rows_N = torch.arange(n, device=offs_L.device)
    l_N = torch.searchsorted(offs_L, rows_N, right=True)
    start_L = offs_L - torch.diff(offs_L, prepend=offs_L.new_zeros(1))
    return l_N, rows_N - start_L[l_N]


class _WeightedSwiGLU(torch.autograd.Function):
    """h_NF = silu(gate) · up · w_N1 from [gate | up] (the up projection's output, saved once: the silu
    and the product are recomputed in backward) and the fp32 combine weight of each row (see above)."""

    @staticmethod
    def forward(ctx, gate_up_N2F, w_N1):
        gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up_N2F, w_N1)
        return F.silu(gate_NF) * up_NF * w_N1.to(up_NF.dtype)

    @staticmethod
    def backward(ctx, dh_NF):
        gate_up_N2F, w_N1 = ctx.saved_tensors
        gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
        sig_NF = torch.sigmoid(gate_NF)
        silu_NF = gate_NF * sig_NF
        # the weight's grad accumulated in fp32 (the weight is the router's fp32 probability): the
        # reduction reads the product in its dtype and sums in fp32, where two .float() copies of [N, F]
        # cost 12 more bytes an element in bf16 for the same sum
        dw_N1 = None
        if ctx.needs_input_grad[1]:
            dw_N1 = (dh_NF * (silu_NF * up_NF)).sum(-1, keepdim=True, dtype=torch.float32).to(w_N1.dtype)
        dwh_NF = dh_NF * w_N1.to(dh_NF.dtype)
        dgate_NF = dwh_NF * up_NF * (sig_NF * (1 + gate_NF * (1 - sig_NF)))
        return torch.cat([dgate_NF, dwh_NF * silu_NF], dim=-1), dw_N1


def weighted_swiglu(gate_up_N2F: torch.Tensor, w_N1: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) · up, times each row's combine weight when given (the experts' activation)."""
    if w_N1 is None:
        gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
        return F.silu(gate_NF) * up_NF
    return _WeightedSwiGLU.apply(gate_up_N2F, w_N1)


def swiglu_experts(
    x_ND: torch.Tensor,
    up_LOD: torch.Tensor,
    down_LDF: torch.Tensor,
    sizes: list[int],
    ends_L: torch.Tensor | None = None,
    w_N1: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of each row block through its expert: up_LOD [L, 2F, D] (fused [gate | up]), down [L, D, F].
    sizes: rows per expert (host); ends_L: their cumulative sums on the device (built here when absent,
    which on CUDA is a host-to-device copy: pass them where they already live on the device). w_N1: each
    row's combine weight, applied before the down projection (see the module doc)."""
    if ends_L is None:
        ends_L = torch.tensor(sizes, device=x_ND.device).cumsum(0)
    ends_L = ends_L.to(torch.int32)
    if grouped_supported(x_ND):
        h_NF = weighted_swiglu(_group_mm(x_ND, up_LOD, ends_L), w_N1)
        return _group_mm(h_NF, down_LDF, ends_L)
    where, m = _rows_where(ends_L, x_ND.shape[0]), max(sizes, default=0)
    h_NF = weighted_swiglu(_padded_mm(x_ND, up_LOD, where, m), w_N1)
    return _padded_mm(h_NF, down_LDF, where, m)
