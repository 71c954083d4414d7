"""The AdamW both optimizer stages run (zero=0 on whole params, zero=1 on owned flat ranges)."""

from __future__ import annotations

import inspect

import torch

from megaframe.config.schema import OptimConfig

MOMENTS = ("exp_avg", "exp_avg_sq")


def _undecorated(fn):
    """fn without torch's lazy `torch._disable_dynamo` / graph-break wrappers, nor the profiler wrapper that
    Optimizer puts on torch's own class once one is built (functools.wraps keeps each `__wrapped__`)."""
    return inspect.unwrap(fn)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, the same update and state, less the dynamo guards around its methods: those
    import torch._dynamo on first call (about 1.4 s of CPU, as much as torch itself), in every process
    that steps an optimizer, although they only matter when the optimizer is traced. megaframe never
    traces it (train.compile compiles the transformer blocks), so a run imports the compiler only when
    it compiles. The step keeps torch's own no-grad rule (`differentiable` is never set here) and its
    profiler range and step hooks (Optimizer wraps every subclass's step with them)."""

    add_param_group = _undecorated(torch.optim.Optimizer.add_param_group)
    zero_grad = _undecorated(torch.optim.Optimizer.zero_grad)
    state_dict = _undecorated(torch.optim.Optimizer.state_dict)
    load_state_dict = _undecorated(torch.optim.Optimizer.load_state_dict)

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _STEP(self, closure)


_STEP = _undecorated(torch.optim.AdamW.step)


def adamw(params_decay, params_no_decay, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only (never norms or biases). Fused kernels on CUDA and on CPU (on CPU
    ~6x faster than foreach); they also take `found_inf`, which skips a step without a host sync."""
    groups = [
        {"params": ps, "weight_decay": wd}
        for ps, wd in ((params_decay, cfg.weight_decay), (params_no_decay, 0.0))
        if ps
    ]
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
