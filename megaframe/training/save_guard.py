"""No poisoned commits: a checkpoint is written only when the state it would hold is finite.

A run of skipped non-finite steps (a loss spike, a diverging learning rate) must not reach a
checkpoint: resume=auto would load it again on every restart. Before each save the trainer asks
`state_is_finite`: every tensor a rank holds (its parameter slices, the update rule's state and fp32
masters: the optimizer's held_state) is checked ON THE DEVICE (one fused isfinite reduction per tensor,
stacked), and the ranks' answers are combined in one scalar all-reduce: one host sync per save, none per
step. A save is also refused while
the last step was skipped for a non-finite grad norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaframe.checkpoint.resume import world_axis
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh


def held_tensors(model, optimizer) -> list[torch.Tensor]:
    """Every tensor of model and optimizer state this rank holds (no collective: the local shards)."""
    # a ZeRO-3 param not gathered now has no storage: its values are the master's, checked below
    out = [p.detach() for p in model.parameters() if p.untyped_storage().nbytes()]
    # the optimizer's rule state and masters (ZeRO: this rank's segments); state not made yet (before the
    # first step, as torch's optimizers) is not held: nothing to check
    out += optimizer.held_state()
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
