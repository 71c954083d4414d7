"""No poisoned commits: a checkpoint is written only when the state it would hold is finite.

A run of skipped non-finite steps (a loss spike, a diverging learning rate) must not reach a
checkpoint: resume=auto would load it again on every restart. Before each save the trainer asks
`state_is_finite`: every tensor a rank holds (its parameter slices, Adam moments and fp32 masters) is
checked ON THE DEVICE (one fused isfinite reduction per tensor, stacked), and the ranks' answers are
combined in one scalar all-reduce: one host sync per save, none per step. A save is also refused while
the last step was skipped for a non-finite grad norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaframe.checkpoint.resume import world_axis
from megaframe.optim.buffer import has_storage
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh


def held_tensors(model, optimizer) -> list[torch.Tensor]:
    """Every tensor of model and optimizer state this rank holds (no collective: the local shards)."""
    # a ZeRO-3 param not gathered now has no storage: its values are the master's, checked below
    out = [p.detach() for p in model.parameters() if p.untyped_storage().nbytes()]
    for st in getattr(optimizer, "states", []):  # ZeRO: this rank's segment of moments and masters
        # moments not made yet (ZeRO makes them at the first step, as torch's AdamW): nothing held to check
        out += [
            t
            for t in (
                getattr(st, "exp_avg", None),
                getattr(st, "exp_avg_sq", None),
                getattr(st, "master", None),
            )
            if isinstance(t, torch.Tensor) and has_storage(t)
        ]
    adam = getattr(optimizer, "adam", None)  # the replicated optimizer: torch's AdamW state
    if adam is not None:
        out += [
            v for s in adam.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
    return out


@torch.no_grad()
def state_is_finite(model, optimizer, mesh: Mesh) -> bool:
    """Whether every rank's held state is finite; collective."""
    tensors = held_tensors(model, optimizer)
    flag = torch.ones(1, device=mesh.device)
    if tensors:
        # reduced on the device: one small tensor, no per-tensor host read
        flag = (
            torch.stack([torch.isfinite(t).all() for t in tensors]).all().float().reshape(1).to(mesh.device)
        )
    # every rank reaches it, also one holding no tensor (flag 1): a rank skipping it would hang the others
    comm.all_reduce(flag, world_axis(mesh), op=dist.ReduceOp.MIN)
    return bool(flag.item())  # the one host sync of the check
