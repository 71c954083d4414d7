"""A mesh for planning: any rank's coordinates and axis sizes, with no process group at all.

`build_model(cfg, virtual_mesh(...))` builds that rank's exact part of the model (shapes, dtypes,
which layers, which shards) on the meta device, so the planner sizes every rank of a 1024-GPU layout
from one process in seconds. Collectives over a virtual axis return tensors of the right shape
without communicating (see comm._enter), so a meta forward also runs under tp and sp.
"""
from __future__ import annotations

import torch

from megaframe.parallel.mesh import Axis, CommStats, Mesh, expert_groups


def virtual_mesh(tp: int, pp: int, dp: int, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0,
                 device: torch.device | str = "meta", ep: int = 1) -> Mesh:
    """The mesh rank (pp_rank, dp_rank, tp_rank) would build, in Megatron's rank order (tp innermost);
    ep folded into dp as build_mesh does (ep blocks of consecutive dp ranks, edp across them)."""
    def rank_of(p: int, d: int, t: int) -> int:
        return t + tp * (d + dp * p)

    stats = CommStats()
    me = rank_of(pp_rank, dp_rank, tp_rank)

    def axis(name: str, size: int, rank: int, members: list[int]) -> Axis:
        return Axis(name, size, rank, tuple(members), None, stats, virtual=size > 1)

    tp_axis = axis("tp", tp, tp_rank, [rank_of(pp_rank, dp_rank, t) for t in range(tp)])
    dp_axis = axis("dp", dp, dp_rank, [rank_of(pp_rank, d, tp_rank) for d in range(dp)])
    pp_axis = axis("pp", pp, pp_rank, [rank_of(p, dp_rank, tp_rank) for p in range(pp)])
    ends = [rank_of(0, dp_rank, tp_rank), rank_of(pp - 1, dp_rank, tp_rank)]
    ends_axis = axis("pp", 2, ends.index(me), ends) if pp > 1 and me in ends else axis("pp", 1, 0, [me])
    ep_axis = edp_axis = None
    if ep > 1:
        ep_blocks, edp_blocks = expert_groups(dp_axis.ranks, ep)
        ep_axis = axis("ep", ep, dp_rank % ep, ep_blocks[dp_rank // ep])
        edp_axis = axis("dp", dp // ep, dp_rank // ep, edp_blocks[dp_rank % ep])
    return Mesh(tp=tp_axis, pp=pp_axis, dp=dp_axis, pp_ends=ends_axis, rank=me, world=tp * pp * dp,
                device=torch.device(device), stats=stats, group=None, ep=ep_axis, edp=edp_axis)
