"""Dropout RNG across tensor-parallel ranks (Megatron's RNG-tracker idea).

Each step the trainer seeds the default generators from (seed, step, pp rank, dp rank) — not the global
rank — so every tp rank draws the same dropout mask on activations the tp ranks hold as replicas (the
residual stream without sp), and the replicas stay equal. Where tp ranks hold different data (attention
heads split over tp; sequence blocks under sp) one shared mask would correlate the blocks, so
`tp_distinct` runs that region on a stream seeded from one draw of the default CPU generator and the tp
rank, then restores the default stream. Deriving it from the default stream, instead of keeping a
second one, lets activation recompute (torch.utils.checkpoint restores the default CPU and CUDA states)
replay the same masks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from megaframe.layers.shard import param_seed
from megaframe.parallel.mesh import Axis, Mesh


def seed_step(seed: int, step: int, mesh: Mesh) -> None:
    """Seed the default generators for optimizer step `step`: equal on the tp ranks of one (pp, dp)
    coordinate; a function of the step, so resuming needs no RNG state."""
    # No tp rank in the key: tp replicas must draw the same masks or their copies of the residual diverge.
    cp = f"/cp{mesh.cp.rank}" if mesh.cp.size > 1 else ""  # cp ranks hold different tokens: own masks
    torch.manual_seed(param_seed(seed, f"dropout/step{step}/pp{mesh.pp.rank}/dp{mesh.dp.rank}{cp}"))


@contextmanager
def tp_distinct(tp: Axis, device: torch.device, active: bool = True):
    """Within: dropout draws differ per tp rank (deterministically). Costs a CPU draw and a generator
    state save/restore, so callers pass active=False when no dropout runs."""
    if not active or tp.size == 1:
        yield
        return
    # a CPU tensor: reading it waits for no device work
    key = int(torch.randint(1 << 62, (), dtype=torch.int64).item())
    devices = [device] if device.type == "cuda" else []
    # fork_rng restores the default stream afterwards: code after the region draws as if it never ran.
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(param_seed(key, f"tp{tp.rank}"))
        yield
