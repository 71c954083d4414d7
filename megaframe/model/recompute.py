"""train.recompute=op_selective: torch's selective activation checkpointing per transformer block, with
the op-level policy torchtitan's Llama runs use (`selective_ac_option="op"`).

Each block runs under `torch.utils.checkpoint` (non-reentrant) with `create_selective_checkpoint_contexts`:
the outputs of the compute-intensive ops are kept (attention kernels, and the matmuls except every
second one, counted per block in forward order), every other op is re-run in backward from the block's
input and those kept outputs. So the expensive work is not repeated while the cheap elementwise
intermediates (norms, SwiGLU, RoPE, residuals) are dropped. The blocks' tp/sp collectives are re-run in
backward, as under full recompute (they are c10d ops writing in place, not functional outputs to keep).

With megaframe's fused projections a Llama block keeps [q|k|v] (its 1st matmul), the attention output
and log-sum-exp, and [gate|up] (its 3rd); it re-runs the attention's out projection and the down
projection (the 2nd and 4th).

`saved_by_policy` lets the planner count what the policy keeps: a SavedBytes-like recorder whose
`pack(t)` is called with every tensor the policy keeps (planning/activations.count_saved installs it),
and `keep_in_region` lets the planner's attention stand-in report the tensors a fused kernel's outputs
would be (planning/activations.FusedAttentionSizes: on meta no real kernel runs).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _ops(*names: str) -> set:
    """The overloads of this torch build among `names` (a CPU build lacks some CUDA kernels' ops)."""
    return {getattr(_aten, n).default for n in names if hasattr(_aten, n)}


MATMULS = _ops("mm", "addmm", "_scaled_mm")
"""Counted for the every-second rule: a linear is mm (addmm with a bias), a float8 GEMM _scaled_mm."""
KEPT = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "max",
)
"""Always kept: the attention kernels (their outputs are what their backward reads: recomputing them is the
cost the mode avoids), and `max` (float8's amax, a scalar that would otherwise cost a reduction again)."""

_recorder: ContextVar = ContextVar("sac_recorder", default=None)
_region: ContextVar = ContextVar("sac_region", default=None)


class OpSelectivePolicy:
    """One block's policy: a fresh instance per checkpointed call, so the matmul count restarts per block
    (torch only asks it in forward; the recompute replays its decisions by op order)."""

    def __init__(self):
        self.matmuls = 0
        self.recorder = _recorder.get()

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            self.matmuls += 1
            keep = self.matmuls % 2 == 1  # the 1st, 3rd, ...: every second matmul is re-run
        else:
            keep = func in KEPT
        if keep:
            self.keep(ctx.op_output)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def keep(self, out) -> None:
        if self.recorder is None:
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.recorder.pack(t)


@contextmanager
def _forward_region(policy: OpSelectivePolicy, caching):
    token = _region.set(policy)
    try:
        with caching:
            yield
    finally:
        _region.reset(token)


def _contexts():
    policy = OpSelectivePolicy()
    caching, cached = create_selective_checkpoint_contexts(policy)
    return _forward_region(policy, caching), cached


def op_selective_checkpoint(fn, *args):
    """fn(*args) under op-level selective checkpointing (RNG state restored for the re-run: same dropout)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)


def keep_in_region(*tensors: torch.Tensor) -> None:
    """Count `tensors` as kept by the active block's policy, if a block runs under op_selective (the
    planner's attention stand-in: what a fused kernel's kept outputs would be)."""
    policy = _region.get()
    if policy is not None:
        policy.keep(tensors)


@contextmanager
def saved_by_policy(recorder):
    """Every tensor a policy created inside keeps is passed to recorder.pack (the planner's counter)."""
    token = _recorder.set(recorder)
    try:
        yield
    finally:
        _recorder.reset(token)
