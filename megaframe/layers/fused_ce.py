"""Output head and cross-entropy in one pass over token chunks (tp = 1): full logits never exist.

Legend: N tokens (S*B flattened), D hidden, V vocab, C tokens per chunk.
Forward, per chunk of C tokens: logits_CV = x_CD @ W^T, log-softmax, the token losses, and right away
their gradient (softmax - onehot): grad_x_CD = g_CV @ W and grad_W += g_CV^T @ x_CD. Only grad_x_ND
and grad_W_VD (parameter-sized) outlive the chunk, so the V-wide buffers stay cache-sized (CPU) or a
bounded slice of memory (GPU: a 128k vocab at 8k tokens would be 4 GiB of fp32 logits, twice).
Same FLOPs as head + cross-entropy, no recompute. The head-weight grad sums over the chunks in fp32
(under bf16 a bf16 sum would round once per chunk). Backward only scales the saved grads by the loss's
upstream grad: exact when that is one value for every token (the trainer's loss is a plain sum, whose
grad arrives as an expanded scalar), otherwise it recomputes chunk by chunk with the per-token weights.
Under train.precision=fp8 the three GEMMs are float8 ones (`gemm`: layers/fp8.py HeadGemms, the weight cast
once per call); the float8 weight-grad GEMM gives a bf16 chunk, summed into the fp32 grad as the others.
"""

from __future__ import annotations

import torch

from megaframe.layers import wgrad
from megaframe.layers.vocab import log_softmax_nll, nll_grad_
from megaframe.layers.wgrad import mixed_gemm
from megaframe.pipeline.split import wanted

CHUNK_ELEMS = {"cpu": 1 << 21, "cuda": 1 << 30}
"""Logits elements per chunk. CPU: 8 MiB of fp32, cache-sized. GPU: a memory budget (2 GiB of bf16 logits,
their grad written over them by the compiled chain): 4k tokens x a 128k vocab is one chunk, so the head's
weight-grad GEMM runs once with K = all tokens and its fp32 result is written once, not re-read and re-written
per chunk."""


def _chunk_tokens(n: int, vocab: int, device: torch.device) -> int:
    """Tokens per chunk: within the device's logits budget, and equal chunks where a divisor of n gives them
    with at most twice the chunks the budget needs (16,384 tokens at a 128k vocab: 2 x 8,192, not 8,372 +
    8,012), so the compiled chain sees one static shape, not a second one that recompiles it."""
    c = max(1, min(n, CHUNK_ELEMS.get(device.type, 1 << 22) // vocab))
    k = -(-n // c)
    for parts in range(k, min(2 * k, k + 1024) + 1):
        if n % parts == 0:
            return n // parts
    return c


def _ce_math(
    logits_CV: torch.Tensor, target_C: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_C fp32, grad_CV = (softmax - onehot) [* scale] in the logits' dtype) as one elementwise chain:
    compiled, one read of the logits (and one for their log-sum-exp) and one write of the grad; fp32 only
    in registers."""
    z_CV = logits_CV.float()
    lse_C = torch.logsumexp(z_CV, dim=-1)
    loss_C = lse_C - z_CV.gather(-1, target_C.unsqueeze(-1)).squeeze(-1)
    hot_CV = torch.arange(z_CV.shape[-1], device=z_CV.device) == target_C.unsqueeze(-1)
    grad_CV = torch.exp(z_CV - lse_C.unsqueeze(-1)) - hot_CV.float()
    return loss_C, (grad_CV if scale is None else grad_CV * scale).to(logits_CV.dtype)


_compiled_math = None


def _chain(
    logits_CV: torch.Tensor, target_C: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """_ce_math compiled on CUDA (the eager chain makes ~7 passes over fp32 copies: 28 B per logit against
    4); eager elsewhere (CPU tests, no compiler wanted), in place over one fp32 copy. Static shapes: the
    chunks are equal (_chunk_tokens), and a run's scale is one constant."""
    global _compiled_math
    if logits_CV.device.type == "cuda":
        if _compiled_math is None:
            _compiled_math = torch.compile(_ce_math, dynamic=False)
        return _compiled_math(logits_CV, target_C, scale)
    logp_CV, loss_C = log_softmax_nll(logits_CV, target_C)
    # in place: the log-probabilities are not needed once the loss is picked
    grad_CV = nll_grad_(logp_CV, target_C)
    return loss_C, (grad_CV if scale is None else grad_CV.mul_(scale)).to(logits_CV.dtype)


def _stop(n: int, c: int, x: torch.Tensor) -> int:
    """Where the chunk loop ends: every token, except on the meta device (the planner's sizing), where one
    chunk has the shapes and saved tensors of all (each is alike) and the loop would be the plan's cost:
    a Python loop of N / C meta ops (a million at seq_length 1e9 never returned)."""
    return min(n, c) if x.device.type == "meta" else n


class _Gemms:
    """The chunks' three GEMMs with w_VD: plain ones, or float8 ones (an Fp8Gemm given: HeadGemms)."""

    def __init__(self, w_VD: torch.Tensor, gemm=None):
        from megaframe.layers.fp8 import HeadGemms

        self.w_VD, self.f8 = w_VD, None if gemm is None else HeadGemms(gemm, w_VD)

    def logits(self, x_CD: torch.Tensor) -> torch.Tensor:
        return x_CD @ self.w_VD.t() if self.f8 is None else self.f8.logits(x_CD)

    def grad_input(self, grad_CV: torch.Tensor, out_CD: torch.Tensor) -> None:
        if self.f8 is None:
            torch.mm(grad_CV, self.w_VD, out=out_CD)
        else:
            out_CD.copy_(self.f8.grad_input(grad_CV))

    def accumulate(
        self, acc_VD: torch.Tensor, grad_CV: torch.Tensor, x_CD: torch.Tensor, first: bool
    ) -> None:
        if self.f8 is None:
            _accumulate(acc_VD, grad_CV, x_CD, first)
        elif first:
            acc_VD.copy_(self.f8.grad_weight(grad_CV, x_CD))
        else:
            acc_VD.add_(self.f8.grad_weight(grad_CV, x_CD))


def _chunk_grads(x_CD, gemms: _Gemms, target_C, g_C=None, scale: float | None = None):
    """(loss_C, grad_logits_CV) of one chunk: softmax - onehot (times g_C or scale where given)."""
    if g_C is None:
        return _chain(gemms.logits(x_CD), target_C, scale)
    logp_CV, loss_C = log_softmax_nll(gemms.logits(x_CD), target_C)
    return loss_C, nll_grad_(logp_CV, target_C, g_C).to(gemms.w_VD.dtype)


def _accumulate(acc_VD: torch.Tensor, grad_CV: torch.Tensor, x_CD: torch.Tensor, first: bool) -> None:
    """acc_VD (fp32) = or += grad_CV^T @ x_CD, in place: no V x D temporary per chunk."""
    if acc_VD.dtype == grad_CV.dtype:  # an fp32 run
        if first:
            torch.mm(grad_CV.t(), x_CD, out=acc_VD)
        else:
            acc_VD.addmm_(grad_CV.t(), x_CD)
    # bf16 operands, the GEMM's own fp32 accumulator written out as fp32 (cuBLAS)
    elif mixed_gemm(acc_VD.device.type):
        if first:
            torch.mm(grad_CV.t(), x_CD, torch.float32, out=acc_VD)
        else:
            torch.addmm(acc_VD, grad_CV.t(), x_CD, torch.float32, out=acc_VD)
    else:  # no mixed-dtype GEMM (CPU, torch < 2.10): upcast the chunk's operands
        _accumulate(acc_VD, grad_CV.float(), x_CD.float(), first)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_VD, target_N, gemm, scale):
        n, c = x_ND.shape[0], _chunk_tokens(x_ND.shape[0], w_VD.shape[0], x_ND.device)
        ctx.gemm, gemms = gemm, _Gemms(w_VD, gemm)
        loss_N = torch.empty(n, dtype=torch.float32, device=x_ND.device)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        gx_ND = torch.empty_like(x_ND) if grads else None
        # The caller's upstream grad known now (`scale`) and the optimizer's fp32 main_grad at hand: the
        # grads are made scaled, dW summed straight into main_grad (4 / 8 B per head parameter, not an fp32
        # temporary scaled in there in backward: 12 / 16); backward checks the scale came.
        main = wgrad.fused_target(w_VD) if scale is not None and ctx.needs_input_grad[1] else None
        ctx.scale, ctx.main = (scale, main) if main is not None and grads else (None, None)
        first = wgrad.note_written(main) if ctx.main is not None else True
        # else the head grad sums over every chunk: accumulate it in fp32 (a bf16 sum would round once per
        # chunk), cast once at the end; the first chunk writes it: no zero fill
        gw_VD = ctx.main if ctx.main is not None else torch.empty_like(w_VD, dtype=torch.float32)
        for lo in range(0, _stop(n, c, x_ND), c):
            x_CD, t_C = x_ND[lo : lo + c], target_N[lo : lo + c]
            if not grads:
                loss_N[lo : lo + c] = log_softmax_nll(gemms.logits(x_CD), t_C)[1]
                continue
            loss_N[lo : lo + c], grad_CV = _chunk_grads(x_CD, gemms, t_C, scale=ctx.scale)
            gemms.grad_input(grad_CV, gx_ND[lo : lo + c])
            gemms.accumulate(gw_VD, grad_CV, x_CD, first=first and lo == 0)
        # fp32 kept when the optimizer takes the grad into its fp32 main_grad (backward scales it in there):
        # no round to bf16 and back; else cast once here
        if grads and ctx.main is None and wgrad.fused_target(w_VD) is None:
            gw_VD = gw_VD.to(w_VD.dtype)
        ctx.save_for_backward(x_ND, w_VD, target_N)
        # our own buffers (neither input nor output): kept on ctx, so scaling them in place in backward
        # trips no saved-tensor version check when a split backward runs this node twice
        ctx.grads = (gx_ND, gw_VD)
        return loss_N

    @staticmethod
    def backward(ctx, g_N):
        x_ND, w_VD, target_N = ctx.saved_tensors
        gx_ND, gw_VD = ctx.grads
        if ctx.scale is not None:
            return (*_scaled_in_forward(ctx, g_N, x_ND, w_VD), None, None, None)
        if g_N.numel() == 1 or g_N.stride(0) == 0:  # one upstream grad for all tokens: scale, no sync
            scale = g_N.reshape(-1)[0]
            # in place, so each grad at most once: a split backward (pipeline/split.py) runs this node for
            # B (the input grad) and again for W (the weight's)
            gx = gx_ND.mul_(scale) if ctx.needs_input_grad[0] and wanted(x_ND) else None
            if not (ctx.needs_input_grad[1] and wanted(w_VD)):
                return gx, None, None, None, None
            main = wgrad.fused_target(w_VD)
            if main is None:
                return gx, gw_VD.mul_(scale), None, None, None
            wgrad.scale_into_main(main, gw_VD, scale)
            return gx, torch.empty_like(w_VD), None, None, None  # fires the param's hook (it drops it)
        c = _chunk_tokens(x_ND.shape[0], w_VD.shape[0], x_ND.device)  # per-token weights: recompute
        acc_VD, gemms = torch.empty_like(w_VD, dtype=torch.float32), _Gemms(w_VD, ctx.gemm)
        for lo in range(0, _stop(x_ND.shape[0], c, x_ND), c):
            _, grad_CV = _chunk_grads(
                x_ND[lo : lo + c], gemms, target_N[lo : lo + c], g_N[lo : lo + c].float()
            )
            gemms.grad_input(grad_CV, gx_ND[lo : lo + c])
            # (rare path: per-token weights)
            gemms.accumulate(acc_VD, grad_CV, x_ND[lo : lo + c], first=lo == 0)
        return gx_ND, acc_VD.to(w_VD.dtype), None, None, None


def _scaled_in_forward(ctx, g_N: torch.Tensor, x_ND: torch.Tensor, w_VD: torch.Tensor):
    """Backward when forward made the grads already times the promised upstream grad (ctx.scale) and summed
    dW into main_grad: hand on grad x as it is; for the weight, check on the device that every token's
    upstream grad is the promised one. A caller that broke the promise (another loss reduction) gets a NaN
    in grad x (flowing into every grad before it) or, without one, in main_grad, so the step's grad norm is
    non-finite and the optimizer skips it (no host sync). Grad x first: it is this micro-batch's own, where
    main_grad is shared with the head's next forward, which an overlapped kind runs at the same time on
    another thread (pipeline/overlap.py: two read-add-writes of one buffer lose one)."""
    gx = ctx.grads[0] if ctx.needs_input_grad[0] and wanted(x_ND) else None
    if not (ctx.needs_input_grad[1] and wanted(w_VD)):
        return gx, None
    kept = ((g_N.float() - ctx.scale).abs() <= 1e-6 * abs(ctx.scale)).all()
    broken = torch.where(kept, 0.0, float("nan"))
    (gx if gx is not None else ctx.main).view(-1)[:1].add_(broken)
    wgrad.pending.add(ctx.main.data_ptr())
    return gx, torch.empty_like(w_VD)  # fires the param's hook, which drops it (wgrad.py)


def linear_cross_entropy(
    x_SBD: torch.Tensor, weight_VD: torch.Tensor, target_SB: torch.Tensor, gemm=None, scale=None
) -> torch.Tensor:
    """Per-token loss_SB of logits x @ W^T against target (tp = 1); equals F.cross_entropy on the logits.
    `gemm`: an Fp8Gemm (train.precision=fp8): the three GEMMs run float8 (layers/fp8.py HeadGemms).
    `scale`: the upstream grad every token's loss will get (the pipeline executor's 1 / tokens per step):
    the grads are made scaled in forward and dW summed straight into the weight's fp32 main_grad."""
    s, b, d = x_SBD.shape
    x_ND, t_N = x_SBD.reshape(s * b, d), target_SB.reshape(s * b)
    return _LinearCrossEntropy.apply(x_ND, weight_VD, t_N, gemm, scale).view(s, b)
