"""optim.step_kernel=compiled: AdamW's update of one owned range in one pass over memory.

torch's fused AdamW updates the fp32 master in place and, given the clip as its grad_scale, writes the
clipped grad back (4 B per element the update never reads again); the strategy then casts the master into
the bf16 param buffer in a second pass (read 4, write 2). Here one function reads the grad, the moments
(fp32 or bf16, widened in registers) and the master once and writes the moments, the master and the bf16
parameter once: per element 4 + 8 + 16 + 2 = 30 B with fp32 moments, 22 with bf16 ones (the global grad
norm's read, 4, comes before: the clip needs the whole norm before any element is updated).

The pass is `_math` compiled by torch.compile (dynamic shapes: one compile for every range size), inductor's
C++ loop on CPU and a Triton kernel on CUDA, behind a custom op whose schema names what it writes, so the
memory-traffic test (tests/unit/optim/test_grad_bytes.py) counts one read of every input and one write of
every output. A compile that fails (no C++ compiler, an old Triton) warns once and runs `_math` eagerly:
the same update in several passes. The compiler is imported on the first compiled step only.
"""

from __future__ import annotations

import sys

import torch

_compiled = None
_failed = False


def _math(
    out: torch.Tensor | None,
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
    betas: tuple[float, float, float],
) -> None:
    """torch's fused AdamW step (its kernel's order of operations) on one range; `scalars` is [step (after
    this update's increment), lr, weight decay, clip divisor, skip] on the device (no host sync, and no
    recompile as lr changes). Where skip is 1 nothing changes."""
    beta1, beta2, eps = betas
    step, lr, wd, divisor, skip = scalars.unbind(0)
    g = grad.float() / divisor
    m0, v0, w0 = exp_avg.float(), exp_avg_sq.float(), master
    w = w0 - w0 * (lr * wd)
    m = m0.lerp(g, 1 - beta1)
    v = v0 * beta2 + g * g * (1 - beta2)
    bias1 = 1 - torch.pow(beta1, step)
    bias2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    w = w - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps)
    keep = skip != 0
    w, m, v = torch.where(keep, w0, w), torch.where(keep, m0, m), torch.where(keep, v0, v)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    master.copy_(w)
    if out is not None:
        out.copy_(w)


def _body(out, grad, master, exp_avg, exp_avg_sq, scalars, beta1: float, beta2: float, eps: float) -> None:
    global _compiled, _failed
    betas = (beta1, beta2, eps)
    if not _failed:
        try:
            if _compiled is None:
                _compiled = torch.compile(_math, dynamic=True)
            _compiled(out, grad, master, exp_avg, exp_avg_sq, scalars, betas)
            return
        except Exception as e:  # a compiler missing or failing: raised before the kernel writes anything
            _failed = True
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(
                f"megaframe: warning: optim.step_kernel=compiled: no compiled update ({why}); eager instead",
                file=sys.stderr,
                flush=True,
            )
    _math(out, grad, master, exp_avg, exp_avg_sq, scalars, betas)


# torch.library's define/impl rather than @custom_op (wgrad.py says why: no compiler import when eager).
# The schema's (a!) marks what the pass writes: the byte counter reads every tensor once, writes those.
torch.library.define(
    "megaframe::adamw_range_",
    "(Tensor(a!)? out, Tensor grad, Tensor(b!) master, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq, "
    "Tensor scalars, float beta1, float beta2, float eps) -> ()",
)
torch.library.impl("megaframe::adamw_range_", "CompositeExplicitAutograd", _body)
adamw_range_ = torch.ops.megaframe.adamw_range_


def scalars_of(steps: torch.Tensor, lr: torch.Tensor, wd: float, divisor, skip: torch.Tensor) -> torch.Tensor:
    """The scalars `_math` reads, one row per range ([n] step counts after the increment): a few small ops
    per group and step, not per range."""
    n = steps.numel()
    div = divisor.float() if divisor is not None else torch.ones((), device=steps.device)
    rest = torch.stack([lr.float(), torch.full_like(lr, wd, dtype=torch.float32), div, skip.float()])
    return torch.cat([steps.float().view(n, 1), rest.expand(n, 4)], dim=1)
