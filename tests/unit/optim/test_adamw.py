"""optim/adamw.py's AdamW is torch's fused AdamW, bit for bit, without importing the compiler."""

from __future__ import annotations

import subprocess
import sys

import torch

from megaframe.optim.adamw import AdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(8, 4, generator=g)),
        torch.nn.Parameter(torch.randn(4, generator=g)),
    ]


def _steps(cls, params, n: int = 3) -> None:
    opt = cls(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    for i in range(n):
        opt.zero_grad(set_to_none=True)
        (sum((p * p).sum() for p in params) * (i + 1)).backward()
        opt.grad_scale = torch.tensor(2.0)  # the clip divisor build.py passes
        opt.found_inf = torch.tensor(float(i == 1))  # step 2 skipped, as for a non-finite grad norm
        opt.step()
    return opt


def test_same_update_and_state_as_torch_adamw():
    ours, ref = _params(0), _params(0)
    opt, ref_opt = _steps(AdamW, ours), _steps(torch.optim.AdamW, ref)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    for k in ref_sd["state"]:
        for name, v in ref_sd["state"][k].items():
            assert torch.equal(sd["state"][k][name], v), (k, name)
    again = _steps(AdamW, _params(1), n=1)
    again.load_state_dict(ref_sd)
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], ref_sd["state"][0]["exp_avg"])


def test_building_and_stepping_leaves_the_compiler_unimported():
    """torch.optim's own methods import torch._dynamo (~1.4 s of CPU) on first call; a run that does not
    compile must not pay it (checked in a fresh interpreter: this one may have imported it already)."""
    code = (
        "import sys, torch; from megaframe.optim.adamw import AdamW\n"
        "p = torch.nn.Parameter(torch.ones(3)); o = AdamW([p], lr=0.1, fused=True)\n"
        "p.sum().backward(); o.step(); o.zero_grad(); o.load_state_dict(o.state_dict())\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_bf16_state_is_torchs_step_with_the_moments_rounded_to_bf16():
    """optim.state_dtype=bf16: the fused kernel on the moments widened to fp32, rounded back after: bit for
    bit torch's AdamW whose moments are rounded to bf16 after every step, a skipped step included."""
    from megaframe.config.schema import OptimConfig
    from megaframe.optim.adamw import RULE

    ours, ref = _params(0), _params(0)
    cfg = OptimConfig(state_dtype="bf16", lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    step = RULE.build({"matrix": ours[:1], "vector": ours[1:]}, cfg, torch.device("cpu"))
    for i in range(3):
        for p in ours:
            p.grad = None
        (sum((p * p).sum() for p in ours) * (i + 1)).backward()
        step.step(1e-2, torch.tensor(2.0), torch.tensor(float(i == 1)))
    ref_opt = _steps(torch.optim.AdamW, ref, n=0)
    for i in range(3):
        ref_opt.zero_grad(set_to_none=True)
        (sum((p * p).sum() for p in ref) * (i + 1)).backward()
        ref_opt.grad_scale, ref_opt.found_inf = torch.tensor(2.0), torch.tensor(float(i == 1))
        ref_opt.step()
        for s in ref_opt.state.values():
            for k in RULE.states:
                s[k].copy_(s[k].bfloat16())
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    for p, r in zip(ours, ref):
        for k in RULE.states:
            assert step.state_of(p)[k].dtype == torch.bfloat16
            assert torch.equal(step.state_of(p)[k].float(), ref_opt.state[r][k])


def test_compiled_pass_is_the_eager_step_to_fp32_rounding_and_writes_the_bf16_param():
    """optim.step_kernel=compiled (adamw_fused.py) on bf16-reduced grads, bf16 state and an fp32 master with
    its bf16 param: the master and moments of the eager step (torch's fused AdamW on fp32 copies of the
    grads and moments) to fp32 rounding, a clip divisor and a skipped step included, and the bf16 param is
    the master rounded (the cast the strategy no longer runs). The pass compiles to one loop (inductor's
    C++ kernel here) with no intermediate buffer: one read of each input, one write of each output."""
    import re

    from torch._inductor.utils import run_and_get_code

    from megaframe.config.schema import OptimConfig
    from megaframe.optim import adamw_fused
    from megaframe.optim.adamw import RULE

    n = 40
    args = [torch.empty(n, dtype=torch.bfloat16), torch.randn(n).bfloat16(), torch.randn(n)]
    args += [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    scalars = adamw_fused.scalars_of(torch.ones(1), torch.tensor(1e-2), 0.1, None, torch.tensor(0.0))[0]
    torch._dynamo.reset()
    compiled = torch.compile(adamw_fused._math, dynamic=True)
    _, code = run_and_get_code(compiled, *args, scalars, (0.9, 0.95, 1e-8))
    assert len(set(re.findall(r"cpp_fused_\w+", code[0]))) == 1, code[0]
    assert not re.findall(r"empty_strided\w*\(", code[0]), code[0]  # no buffer allocated

    cfg = OptimConfig(state_dtype="bf16", lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    compiled_cfg = OptimConfig(**{**cfg.__dict__, "step_kernel": "compiled"})
    ours, ref = _params(0), _params(0)
    for p in ours:
        p.grad_dtype = None  # bf16 grads on the fp32 master, as ZeRO's segments under bf16 reduction
        p.low = torch.empty_like(p, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    fused = RULE.build({"matrix": ours[:1], "vector": ours[1:]}, compiled_cfg, cpu)
    eager = RULE.build({"matrix": ref[:1], "vector": ref[1:]}, cfg, cpu)
    assert fused.writes_low(ours[0]) and not eager.writes_low(ref[0])
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        grads = [torch.randn(p.shape, generator=g).bfloat16() for p in ours]
        for p, r, gr in zip(ours, ref, grads):
            p.grad, r.grad = gr, gr.float()
        fused.step(1e-2, torch.tensor(2.0), torch.tensor(float(i == 1)))
        eager.step(1e-2, torch.tensor(2.0), torch.tensor(float(i == 1)))
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.low, p.detach().bfloat16())
        for k in RULE.states:
            a, b = fused.state_of(p)[k].float(), eager.state_of(r)[k].float()
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-6)  # bf16: one rounding apart at most
        assert fused.adam.state[p]["step"].item() == eager.adam.state[r]["step"].item() == 2
    assert not adamw_fused._failed  # the compiled pass ran, not the eager fallback


def test_a_compile_that_fails_warns_once_and_runs_the_same_update_eagerly(monkeypatch, capsys):
    """optim.step_kernel=compiled without a working compiler (no C++ compiler, an old Triton): one warning
    line, then the same math in eager ops, equal to the eager step; nothing was written before it failed."""
    from megaframe.config.schema import OptimConfig
    from megaframe.optim import adamw_fused
    from megaframe.optim.adamw import RULE

    def no_compiler(fn, **kw):
        def fail(*a, **k):
            raise RuntimeError("no working C++ compiler\ndetails")

        return fail

    monkeypatch.setattr(adamw_fused, "_compiled", None)
    monkeypatch.setattr(adamw_fused, "_failed", False)
    monkeypatch.setattr(torch, "compile", no_compiler)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours, ref = _params(0), _params(0)
    fused = RULE.build(
        {"matrix": ours[:1], "vector": ours[1:]},
        OptimConfig(**{**cfg.__dict__, "step_kernel": "compiled"}),
        torch.device("cpu"),
    )
    eager = RULE.build({"matrix": ref[:1], "vector": ref[1:]}, cfg, torch.device("cpu"))
    for i in range(2):
        for p, r in zip(ours, ref):
            p.grad = r.grad = torch.full_like(p, 0.5 * (i + 1))
        fused.step(1e-2, torch.tensor(2.0), torch.tensor(0.0))
        eager.step(1e-2, torch.tensor(2.0), torch.tensor(0.0))
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "megaframe: warning: optim.step_kernel=compiled: no compiled update "
        "(RuntimeError: no working C++ compiler); eager instead"
    ], err
    assert adamw_fused._failed
