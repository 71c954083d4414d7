"""The plain data-parallel optimizer (optim.zero=0) and the choice among the three implementations of
optim/protocol.py's Optimizer."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megaframe.config.schema import OptimConfig
from megaframe.optim.finalize import clip_divisor, finalize
from megaframe.optim.grads import ReplicatedGrads
from megaframe.optim.protocol import Optimizer
from megaframe.optim.rule_registry import rule_named
from megaframe.optim.update_rule import STATE_DTYPES
from megaframe.optim.zero import ZeroOptimizer
from megaframe.parallel.mesh import Mesh


class PlainOptimizer(Optimizer):
    """The update rule on whole replicated params; grads all-reduced over dp in flat buckets after the last
    micro-batch."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, mesh: Mesh):
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self.params = list(model.parameters())
        self.rule = rule_named(cfg.name)
        groups = {
            "matrix": [p for p in self.params if p.ndim >= 2],
            "vector": [p for p in self.params if p.ndim < 2],
        }
        self.update = self.rule.build(groups, cfg, mesh.device, mesh)
        self.grads = ReplicatedGrads(model, mesh)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def backward_context(self, is_last: bool):
        return contextlib.nullcontext()

    def step(self, lr: float) -> torch.Tensor:
        norm = finalize(self.grads, self.mesh, self.cfg.clip_grad, clip=False)
        # Clipped inside the rule's step. Every rank computed the same global norm, so all ranks skip (or
        # not) together and stay replicas; a NaN/Inf skips the update without a host sync.
        self.update.step(lr, clip_divisor(norm, self.cfg.clip_grad), (~torch.isfinite(norm)).float())
        return norm

    def sync_params(self) -> None:
        """Nothing in flight: the update writes the params in place."""

    def settle(self) -> None:
        """Before a save: nothing to do (see sync_params)."""

    def logical_state(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        return self.update.state_of(p)

    def load_targets(self, p: nn.Parameter) -> tuple[list[tuple[int, int, dict[str, torch.Tensor]]], bool]:
        """Where a checkpoint's state of p is read to (checkpoint/load.py): p's state, made here at its
        size (every rank holds all of it), as one segment; no master (a saved master goes into p itself)."""
        # zeros: defined, whatever is read
        dtype = STATE_DTYPES[self.cfg.state_dtype]
        names = self.rule.states_for(p.placement)
        state = {k: torch.zeros(p.shape, dtype=dtype, device=p.device) for k in names}
        self.update.adopt(p, state)
        return [(0, p.numel(), {k: t.view(-1) for k, t in state.items()})], False

    def loaded(self, p: nn.Parameter, kinds: set[str], step: int) -> None:
        self.update.set_step(p, step)

    def held_state(self) -> list[torch.Tensor]:
        return self.update.held()

    def memory_bytes(self) -> dict[str, int]:
        grads = sum(
            p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None
        )
        optim = sum(v.numel() * v.element_size() for v in self.held_state())
        return {"mem/grads_bytes": grads, "mem/optim_bytes": optim}


def build_optimizer(model: nn.Module, cfg: OptimConfig, mesh: Mesh) -> Optimizer:
    """optim.zero=1, 2: the ZeRO-1/-2 distributed optimizer (zero.py); 3: ZeRO-3 (zero3.py); 0: the rule on
    replicated params (fp32 params only). Each runs the update rule optim.name chooses
    (optim/rule_registry.py).

    With one data-parallel rank and fp32 params ZeRO has nothing to shard and no master copy to keep, so
    the replicated optimizer runs instead: same math and state, without the flat-buffer copies and
    per-parameter hooks (~3% of a CPU step in benchmarks/bench_vs_hf.py)."""
    fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    if cfg.zero == 3 and mesh.dp.size > 1:
        from megaframe.optim.zero3 import Zero3Optimizer  # noqa: PLC0415 (zero3 imports zero)

        return Zero3Optimizer(model, cfg, mesh)
    if cfg.zero and not (mesh.dp_shard.size == 1 and fp32):
        return ZeroOptimizer(model, cfg, mesh)
    assert fp32, "optim.zero=0 needs fp32 parameters"
    return PlainOptimizer(model, cfg, mesh)
