"""The AdamW update rule (optim/update_rule.py): torch's fused AdamW, run by every strategy (zero=0 on whole
params, ZeRO on owned flat ranges). Its state names are written here only."""

from __future__ import annotations

import inspect

import torch

from megaframe.config.schema import OptimConfig
from megaframe.optim.update_rule import STATE_DTYPES, Groups, RuleStep, UpdateRule

MOMENTS = ("exp_avg", "exp_avg_sq")
WIDEN_NUMEL = 1 << 24
"""bf16 state: moments widened to fp32 at most this many elements at a time (64 MiB each), the transient."""


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


class AdamWStep(RuleStep):
    """The rule's step: one torch AdamW over the groups; the clip is its grad_scale, the skip its found_inf
    (one fused pass, no host sync). optim.state_dtype=bf16: the same fused kernel on the moments widened to
    fp32 a batch at a time, rounded back to bf16 after (the update and the weights stay fp32)."""

    def __init__(self, groups: Groups, cfg: OptimConfig, device: torch.device, mesh=None):
        self.device, self.dtype = device, STATE_DTYPES[cfg.state_dtype]
        self.compiled = cfg.step_kernel == "compiled"
        self.adam = adamw(groups.get("matrix", []), groups.get("vector", []), cfg, device)

    def adopt(self, weights: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        # torch's AdamW keeps state it finds; fused AdamW wants its step count as an fp32 tensor on the
        # params' device, never a Python int
        step = torch.zeros((), dtype=torch.float32, device=self.device)
        self.adam.state[weights] = {"step": step, **{k: views[k] for k in MOMENTS}}

    def state_of(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.adam.state.get(weights, {})
        return {k: state[k] for k in MOMENTS if k in state}

    def set_step(self, weights: torch.Tensor, step: int) -> None:
        self.adam.state[weights]["step"] = torch.tensor(float(step), device=self.device)

    def writes_low(self, weights: torch.Tensor) -> bool:
        # the compiled pass writes the low-precision param (weights.low) itself
        return self.compiled and getattr(weights, "low", None) is not None

    def step(self, lr: float, divisor: torch.Tensor, skip: torch.Tensor) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr
        if self.compiled:
            self._step_compiled(lr, divisor, skip)
            return
        if self.dtype != torch.float32:
            self._step_widened(divisor, skip)
            return
        self.adam.grad_scale = divisor
        # where found_inf is 1 the fused kernel leaves params, moments and its step count untouched
        self.adam.found_inf = skip
        self.adam.step()

    @torch.no_grad()
    def _step_compiled(self, lr: float, divisor: torch.Tensor | None, skip: torch.Tensor) -> None:
        """optim.step_kernel=compiled: one pass per range (adamw_fused.py), the step counts kept as torch's
        (one fp32 tensor per range, not advanced by a skipped step)."""
        from megaframe.optim.adamw_fused import adamw_range_, scalars_of

        lr_t = torch.tensor(lr, dtype=torch.float32).to(self.device, non_blocking=True)
        for group in self.adam.param_groups:
            ws = [w for w in group["params"] if w.grad is not None]
            for w in ws:
                if w not in self.adam.state:  # zero=0: made at the first update, as torch's, in our dtype
                    self.adopt(w, {k: torch.zeros_like(w, dtype=self.dtype) for k in MOMENTS})
            if not ws:
                continue
            states = [self.adam.state[w] for w in ws]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            rows = scalars_of(torch.stack(steps), lr_t, group["weight_decay"], divisor, skip)
            beta1, beta2 = group["betas"]
            for w, s, row in zip(ws, states, rows.unbind(0)):
                low = getattr(w, "low", None)
                adamw_range_(low, w.grad, w, s["exp_avg"], s["exp_avg_sq"], row, beta1, beta2, group["eps"])
            torch._foreach_sub_(steps, [skip] * len(steps))

    @torch.no_grad()
    def _step_widened(self, divisor: torch.Tensor, skip: torch.Tensor) -> None:
        for group in self.adam.param_groups:
            batch, numel = [], 0
            for w in group["params"]:
                if w.grad is None:
                    continue
                if w not in self.adam.state:  # zero=0: made at the first update, as torch's, in our dtype
                    self.adopt(w, {k: torch.zeros_like(w, dtype=self.dtype) for k in MOMENTS})
                batch.append(w)
                numel += w.numel()
                if numel >= WIDEN_NUMEL:
                    self._fused_widened(group, batch, divisor, skip)
                    batch, numel = [], 0
            if batch:
                self._fused_widened(group, batch, divisor, skip)

    def _fused_widened(self, group: dict, ws: list, divisor: torch.Tensor, skip: torch.Tensor) -> None:
        """torch's fused AdamW step (torch.optim.adam._fused_adam's calls) on fp32 copies of the moments."""
        states = [self.adam.state[w] for w in ws]
        wide = {k: [s[k].float() for s in states] for k in MOMENTS}
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            ws,
            [w.grad for w in ws],
            wide["exp_avg"],
            wide["exp_avg_sq"],
            [],
            steps,
            amsgrad=False,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            grad_scale=divisor,
            found_inf=skip,
        )
        torch._foreach_sub_(steps, [skip] * len(steps))
        for k in MOMENTS:
            torch._foreach_copy_([s[k] for s in states], wide[k])

    def held(self) -> list[torch.Tensor]:
        return [
            v
            for s in self.adam.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]


RULE = UpdateRule(
    name="adamw",
    states=MOMENTS,
    state_bytes={"fp32": (4, 4), "bf16": (2, 2)},
    elementwise=True,
    build=AdamWStep,
)
