"""A mesh for planning: any rank's coordinates and axis sizes, with no process group at all.

`build_model_for(..., virtual_mesh(...))` builds that rank's exact part of the model (shapes, dtypes,
which layers, which shards) on the meta device, so the planner sizes every rank of a 1024-GPU layout
from one process in seconds. Collectives over a virtual axis return tensors of the right shape
without communicating (see comm/accounting.py: enter), so a meta forward also runs under tp and sp.
"""

from __future__ import annotations

import torch

from megaframe.parallel.mesh import Mesh, RankGrid, mesh_at


def virtual_mesh(
    tp: int,
    pp: int,
    dp: int,
    tp_rank: int = 0,
    pp_rank: int = 0,
    dp_rank: int = 0,
    device: torch.device | str = "meta",
    ep: int = 1,
    shard: int = 0,
    cp: int = 1,
    cp_rank: int = 0,
    etp: int = 1,
) -> Mesh:
    """The mesh rank (pp_rank, dp_rank, tp_rank, cp_rank) would build: build_mesh's own RankGrid and
    mesh_at, with no process groups."""
    grid = RankGrid(tp, dp, pp, ep=ep, shard=shard, cp=cp, etp=etp)
    return mesh_at(grid, grid.position(pp_rank, dp_rank, tp_rank, cp_rank), device, range(grid.world))
