"""Gradient-accumulation fusion (Megatron's `gradient_accumulation_fusion`): the weight-grad GEMM of a linear
writes or accumulates straight into the weight's fp32 `main_grad` (ZeRO's grad buffer slice).

Legend: N tokens (flattened sequence x batch), I input features, O output features.

Without it autograd writes a fresh grad in the param's dtype and ZeRO's post-accumulate hook adds it into the
fp32 buffer: for bf16 params 2 B written + 2 read + 8 read-modify-written = 12 B per parameter per
micro-batch. With it the GEMM's own fp32 accumulator lands in main_grad: 4 B written by the step's first
backward (so zero_grad has nothing to zero), 8 B (read + write, cuBLAS beta = 1) by the later ones.

The weight still gets a grad from autograd (an uninitialised tensor, never read or written), so its
post-accumulate hook fires as before and ZeRO's bucket readiness and reduce-scatter overlap are unchanged;
the hook sees the main_grad's address in `pending` and drops that tensor instead of adding it.

The GEMM is a custom op mutating main_grad, so torch.compile'd blocks keep it as one opaque call (inductor
hands it the real buffer, no copy): whether this backward writes or accumulates is decided when it runs,
from `written`, which the optimizer clears at zero_grad.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megaframe.pipeline.split import wanted

written: set[int] = set()
"""Addresses of main_grads holding this step's grads already (the next GEMM accumulates); zero_grad clears
its params' entries."""
calls = 0
"""Weight-grad GEMMs run into a main_grad so far (tests check that compiled blocks take this path)."""
pending: set[int] = set()
"""Addresses of main_grads a fused GEMM wrote since their param's hook last ran (the hook drops the dummy)."""


@functools.cache
def mixed_gemm(device_type: str) -> bool:
    """Whether this torch has mm/addmm(bf16, bf16, out_dtype=fp32) with an fp32 `self` on this device.

    The overloads are CUDA-only, absent before torch 2.8 (TypeError), and 2.8/2.9 refuse an fp32 `self` with
    bf16 mats (RuntimeError); torch>=2.6 is allowed and NGC containers ship their own torch, so probe
    once per device type and fall back to upcasting instead of dying on step 1. Nothing is read back
    from the device: the checks raise on the host, so the probe adds no sync."""
    try:
        a_22 = torch.zeros(2, 2, dtype=torch.bfloat16, device=device_type)
        acc_22 = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
        torch.mm(a_22, a_22, torch.float32, out=acc_22)
        torch.addmm(acc_22, a_22, a_22, torch.float32, out=acc_22)
    except (TypeError, RuntimeError):  # NotImplementedError (no kernel for the device) is a RuntimeError
        return False
    return True


# Defined and implemented through torch.library's define/impl rather than @custom_op: custom_op wraps every
# kernel call in torch._disable_dynamo, whose first call imports torch._dynamo (~1.4 s of CPU) in each rank
# of an eager run. The schema's (a!) marks `main` mutated, which is all compile needs to keep it opaque.
torch.library.define("megaframe::wgrad_into_main", "(Tensor(a!) main, Tensor g_NO, Tensor x_NI) -> ()")


@torch.library.register_fake("megaframe::wgrad_into_main")
def _wgrad_into_main_fake(main: torch.Tensor, g_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    return None


def wgrad_body(main: torch.Tensor, g_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    """main (fp32, [O, I]) = or += g_NO^T @ x_NI: written by the step's first backward, accumulated after."""
    global calls
    calls += 1
    ptr = main.data_ptr()
    first = ptr not in written
    written.add(ptr)
    pending.add(ptr)
    g_ON = g_NO.t()
    if main.dtype != g_NO.dtype and not mixed_gemm(main.device.type):
        # no mixed-dtype GEMM here (CPU): widen the activations (token-sized), never the parameter-sized grad
        g_ON, x_NI = g_ON.float(), x_NI.float()
    if main.dtype == g_ON.dtype:
        if first:
            torch.mm(g_ON, x_NI, out=main)
        else:
            main.addmm_(g_ON, x_NI)
    elif first:  # bf16 operands, the GEMM's fp32 accumulator written out as fp32 (cuBLAS, beta = 0 / 1)
        torch.mm(g_ON, x_NI, torch.float32, out=main)
    else:
        torch.addmm(main, g_ON, x_NI, torch.float32, out=main)


torch.library.impl("megaframe::wgrad_into_main", "CompositeExplicitAutograd", wgrad_body)
wgrad_into_main = torch.ops.megaframe.wgrad_into_main


class _FusedWgradLinear(torch.autograd.Function):
    """y = x @ W^T; backward: grad x as F.linear's, grad W into W.main_grad (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_NI, w_OI, main_OI):
        ctx.save_for_backward(x_NI, w_OI)
        # on ctx, not saved: other micro-batches' backwards write main between this forward and its backward
        # (a saved tensor's version check would refuse that), and it is written, never read for the math
        ctx.main = main_OI
        return F.linear(x_NI, w_OI)

    @staticmethod
    def backward(ctx, g_NO):
        x_NI, w_OI = ctx.saved_tensors
        main_OI = ctx.main
        # a split backward (zero-bubble, never compiled: config/checks.py) asks for the input grad (B) and the
        # weight's (W) in two passes; a compiled backward is traced once and wants both
        whole = torch.compiler.is_compiling()
        gx = g_NO @ w_OI if ctx.needs_input_grad[0] and (whole or wanted(x_NI)) else None
        gw = None
        if ctx.needs_input_grad[1] and (whole or wanted(w_OI)):
            wgrad_into_main(main_OI, g_NO.reshape(-1, g_NO.shape[-1]), x_NI.reshape(-1, x_NI.shape[-1]))
            gw = torch.empty_like(w_OI)  # fires the param's hook; never read (the hook drops it)
        return gx, gw, None


def fused_target(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 main_grad a linear's weight-grad GEMM writes into, when its optimizer asks for it."""
    return weight.main_grad if getattr(weight, "fuse_wgrad", False) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the weight grad accumulated into weight.main_grad where the optimizer set fuse_wgrad."""
    main = fused_target(weight) if torch.is_grad_enabled() and weight.requires_grad else None
    if main is None:
        return F.linear(x, weight, bias)
    y = _FusedWgradLinear.apply(x, weight, main)
    return y if bias is None else y + bias


@torch.no_grad()
def scale_into_main(main: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor) -> None:
    """main = or += grad * scale (the fused head's fp32 weight grad, scaled by the loss's upstream grad)."""
    first = note_written(main)
    pending.add(main.data_ptr())
    if first:
        torch.mul(grad, scale, out=main)
    else:
        main.addcmul_(grad, scale)


def take_fused(main: torch.Tensor) -> bool:
    """For the param's hook: whether a fused GEMM wrote main since the hook last ran (then p.grad is the
    never-written dummy to drop)."""
    ptr = main.data_ptr()
    if ptr in pending:
        pending.discard(ptr)
        return True
    return False


def note_written(main: torch.Tensor) -> bool:
    """Mark main as holding this step's grads; returns whether it was the first write of the step."""
    ptr = main.data_ptr()
    first = ptr not in written
    written.add(ptr)
    return first


def forget(mains) -> None:
    """zero_grad: these main_grads hold no grads of the new step."""
    for m in mains:
        written.discard(m.data_ptr())
        pending.discard(m.data_ptr())
