"""All local experts' GEMMs at once: one grouped matmul per projection, no Python loop over experts.

Legend: N rows routed to this rank's experts (grouped by local expert), L local experts, D hidden,
F expert width, M the largest group's rows (padded path).

`torch._grouped_mm(x_ND, w_LDO, offs=offs_L)` multiplies each row block (ending at offs_L[l]) by its
expert's weight in one kernel: CUTLASS grouped GEMM on Hopper (bf16), a native kernel on CPU. Where the
backend has none (CUDA before sm90, fp32 on CUDA), the rows are scattered into an [L, M, D] zero-padded
batch and multiplied by one bmm. Both paths are exact against the per-expert loop (the tests hold them to
it bit for bit on CPU); both take the group ends on the device, so neither adds a host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_supported(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs for x's device and dtype (CPU: any float; CUDA: bf16 on sm90+)."""
    if not hasattr(torch, "_grouped_mm") or x.is_meta:
        return False
    if x.device.type == "cpu":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def _group_mm(x_ND: torch.Tensor, w_LOI: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
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


def swiglu_experts(
    x_ND: torch.Tensor,
    up_LOD: torch.Tensor,
    down_LDF: torch.Tensor,
    sizes: list[int],
    ends_L: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of each row block through its expert: up_LOD [L, 2F, D] (fused [gate | up]), down [L, D, F].
    sizes: rows per expert (host); ends_L: their cumulative sums on the device (built here when absent,
    which on CUDA is a host-to-device copy: pass them where they already live on the device)."""
    if ends_L is None:
        ends_L = torch.tensor(sizes, device=x_ND.device).cumsum(0)
    ends_L = ends_L.to(torch.int32)
    if grouped_supported(x_ND):
        gate_NF, up_NF = _group_mm(x_ND, up_LOD, ends_L).chunk(2, dim=-1)
        return _group_mm(F.silu(gate_NF) * up_NF, down_LDF, ends_L)
    where, m = _rows_where(ends_L, x_ND.shape[0]), max(sizes, default=0)
    gate_NF, up_NF = _padded_mm(x_ND, up_LOD, where, m).chunk(2, dim=-1)
    return _padded_mm(F.silu(gate_NF) * up_NF, down_LDF, where, m)
