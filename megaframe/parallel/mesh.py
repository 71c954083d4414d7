"""The process mesh: which ranks share a tensor-, pipeline- or data-parallel group, and this rank's place.

Global rank order (`RankGrid`, shared with the planner's virtual meshes) is tp innermost, then cp,
then dp, then pp outermost (Megatron's order), so a tp group is a block of consecutive ranks and
tensor-parallel traffic stays on one node:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

cp sits between tp and dp: its all-gather of K/V runs every layer, forward and backward, so a cp group
(tp·cp consecutive ranks with its tp peers) stays inside a node whenever tp·cp <= GPUs per node, while
dp, whose grads are reduced once per step, spans nodes. Parameters are replicated over cp, so their
grads are reduced (and ZeRO-sharded) over the combined `dpcp` axis (cp·dp ranks: Megatron's dp-cp
group), dpcp_rank = cp_rank + cp * dp_rank; with cp = 1 it is the dp axis itself.

Expert parallelism is folded over tp·cp·dp (Megatron's "MoE parallel folding"; the arithmetic and its
reasons in parallel/rank_grid.py): etp, ep and edp cut the ranks of a pipeline stage again for the expert
layers alone, stage_rank = tp_rank + tp * dpcp_rank = etp_rank + etp * (ep_rank + ep * edp_rank). With
ep = etp = 1 experts are replicated like the router (over tp, grads partial under sp) and edp is dpcp.

Hybrid sharded data parallelism (optim.shard_group_size = s) cuts the ZeRO axis dpcp (dp itself when
cp = 1) the same way: `dp_shard`, blocks of s consecutive dpcp ranks over which ZeRO shards grads, state
(and params), and `dp_rep`, the cp·dp/s ranks at the same position of their block, which hold equal
shards (all-reduced over it):

    dpcp_rank = cp_rank + cp * dp_rank = shard_rank + s * rep_rank

Under cp the shard group is cut from cp·dp, not dp, because the cp ranks hold the same params: with s a
multiple of cp a shard group is s/cp whole cp groups and the replicas are dp ranks, torchtitan's and
Megatron's dp_shard·cp x dp_replicate; with s < cp it lies inside one cp group. Either way it is s
neighbouring ranks (tp aside): the reduce-scatters and gathers of every micro-batch stay near, and only
the once-a-step all-reduce over dp_rep crosses the farther ranks. Any s dividing cp·dp is exact: the
grads are summed within the shard group and then over its replicas, i.e. over all cp·dp ranks.

The mesh is built once from the config and passed to every layer, the optimizer and the data loader.
Axes of size 1 carry no process group: the collectives in `comm` never communicate over them, which is
also why one process needs no torch.distributed at all.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megaframe.parallel.flight import CommStats
from megaframe.parallel.lanes import LANED
from megaframe.parallel.p2p_semantics import NcclStream, P2PSemantics, semantics_from_env, stream_for
from megaframe.parallel.rank_grid import RankGrid

__all__ = ["Axis", "CommStats", "Mesh", "RankGrid", "build_mesh", "mesh_at", "single_process_mesh"]

REUSABLE = ("dp", "cp", "dpcp", "ep", "edp", "dp_shard", "dp_rep", "etp", "edp_shard", "edp_rep")
"""Axes whose collectives are all-reduces, gathers and all-to-alls of whole groups (never p2p): one of them
over the same ranks as another shares its process group (tp, pp and pp_ends keep their own)."""


@dataclass(frozen=True)
class Axis:
    """One parallel dimension seen from this rank: group, size, coordinate and global ranks in order."""

    name: str
    size: int
    rank: int
    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup]
    stats: CommStats
    virtual: bool = False
    """A planning axis (megaframe.parallel.virtual): sizes and coordinates only; collectives return
    tensors of the right shape without communicating."""
    twin: Optional[dist.ProcessGroup] = None
    """A second communicator over the same ranks, for the overlapped pipeline kinds' second lane
    (parallel/lanes.py: a forward and a backward running at once each enter their own); None elsewhere."""
    p2p: Optional[NcclStream] = None
    """The pipeline axis's emulated NCCL p2p stream (MEGAFRAME_P2P_SEMANTICS=nccl, parallel/p2p_semantics.py);
    None: point-to-point transfers use the backend's own semantics."""

    def __post_init__(self):
        assert self.size == 1 or self.group is not None or self.virtual, (
            f"axis {self.name} of size {self.size} needs a group"
        )


@dataclass(frozen=True)
class Mesh:
    """Frozen layout of this rank: the tp, pp, dp (and ep, edp)
    axes, the device, and the shared byte counter."""

    tp: Axis
    pp: Axis
    dp: Axis
    pp_ends: Axis
    """First and last pipeline rank of this pipeline (tied-embedding grads); size 1 elsewhere."""
    rank: int
    world: int
    device: torch.device
    stats: CommStats
    group: Optional[dist.ProcessGroup] = None
    """All ranks of this mesh (barriers, gathering checkpoint metadata, the stop flag); None for one
    process. Its timeout is the checkpoint save's (build_mesh's world_timeout). gloo on every device: its
    few small exchanges are host-side decisions, and an NCCL communicator over the whole world would cost
    GPU buffers (NVLS memory on H100) for nothing; comm.all_reduce stages a device tensor through the host."""
    ep: Optional[Axis] = None
    """Expert-parallel axis: ep ranks of the stage's folded expert grid holding different experts (the
    all-to-all of tokens; rank_grid.py); bytes count as ep."""
    edp: Optional[Axis] = None
    """Expert-data-parallel axis: the tp·cp·dp/(ep·etp) ranks holding the same expert slices (expert grads,
    ZeRO shards of expert params); its bytes count as dp traffic. The dpcp axis itself when ep = etp = 1."""
    dp_shard: Optional[Axis] = None
    """HSDP: the s consecutive cp·dp ranks ZeRO shards over (bytes count as dp); dpcp itself by default."""
    dp_rep: Optional[Axis] = None
    """HSDP: the cp·dp ranks holding the same shard (their shards are all-reduced; bytes count as dp);
    size 1 by default."""

    cp: Optional[Axis] = None
    """Context-parallel axis: ranks holding different chunks of the same sequences (K/V all-gathered)."""
    dpcp: Optional[Axis] = None
    """cp·dp ranks of one (tp, pp) coordinate: the grad reduction and ZeRO axis of dense params (bytes count
    as dp). The dp axis itself when cp = 1."""

    etp: Optional[Axis] = None
    """Experts' own tensor-parallel axis (parallel.etp): ranks holding different slices of the same experts
    (tokens all-gathered over it after the dispatch); size 1 by default."""
    edp_shard: Optional[Axis] = None
    """HSDP with experts: the edp ranks ZeRO shards expert state over (edp itself without HSDP)."""
    edp_rep: Optional[Axis] = None
    """HSDP with experts: the edp ranks holding the same expert shard; size 1 without HSDP."""
    ep_node: Optional[Axis] = None
    """parallel.ep_dispatch=node: the ep ranks on this rank's node (consecutive ep ranks); None otherwise."""
    ep_rail: Optional[Axis] = None
    """parallel.ep_dispatch=node: one ep rank per node, each at this rank's place on its node, in node order
    (a token crosses nodes over it once per node it needs); None otherwise. Bytes of both count as ep."""

    def __post_init__(self):
        if self.cp is None:
            object.__setattr__(self, "cp", Axis("cp", 1, 0, (self.dp.ranks[self.dp.rank],), None, self.stats))
        if self.dpcp is None:
            object.__setattr__(self, "dpcp", self.dp)
        if self.ep is None:  # a mesh without expert parallelism: ep of size 1, edp = dpcp
            object.__setattr__(self, "ep", Axis("ep", 1, 0, (self.dp.ranks[self.dp.rank],), None, self.stats))
        if self.edp is None:  # experts replicated over cp·dp: every cp rank's tokens reach them
            object.__setattr__(self, "edp", self.dpcp)
        if self.dp_shard is None:
            object.__setattr__(self, "dp_shard", self.dpcp)  # no HSDP: ZeRO shards over all of cp·dp
        if self.dp_rep is None:
            object.__setattr__(self, "dp_rep", self._alone("dp"))
        if self.etp is None:
            object.__setattr__(self, "etp", self._alone("etp"))
        # unfolded experts (ep = etp = 1) are sharded and replicated as the dense params are
        unfolded = self.edp is self.dpcp
        if self.edp_shard is None:
            object.__setattr__(self, "edp_shard", self.dp_shard if unfolded else self.edp)
        if self.edp_rep is None:
            object.__setattr__(self, "edp_rep", self.dp_rep if unfolded else self._alone("dp"))

    def _alone(self, name: str) -> Axis:
        """An axis of size 1 holding this rank only."""
        return Axis(name, 1, 0, (self.dp.ranks[self.dp.rank],), None, self.stats)

    @property
    def experts_folded(self) -> bool:
        """Whether experts lie on the folded grid (ep·etp > 1): not replicated over tp, their tp peers
        being ep, etp or edp peers; else replicated over tp like the router."""
        return self.ep.size * self.etp.size > 1

    @property
    def is_logger(self) -> bool:
        """The one rank that writes metrics and talks to wandb: first rank of the last pipeline stage."""
        return (
            self.tp.rank == 0 and self.cp.rank == 0 and self.dp.rank == 0 and self.pp.rank == self.pp.size - 1
        )

    def describe(self) -> str:
        ep = f" ep={self.ep.size}" if self.ep.size > 1 else ""
        ep += f" etp={self.etp.size}" if self.etp.size > 1 else ""
        if self.ep_rail is not None and self.ep_rail.size > 1:
            ep += f" (dispatch by node: {self.ep_rail.size} nodes of {self.ep_node.size} ep ranks)"
        p2p = " p2p=nccl-emulated" if self.pp.p2p is not None else ""
        cp = f" cp={self.cp.size}" if self.cp.size > 1 else ""
        return (
            f"world={self.world} tp={self.tp.size}{cp} pp={self.pp.size} dp={self.dp.size}{ep} "
            f"device={self.device.type}{p2p}"
        )


def mesh_at(
    grid: RankGrid,
    position: int,
    device,
    ranks: Sequence[int],
    groups: Optional[dict] = None,
    everyone=None,
    emulate_nccl: bool = False,
    twins: Optional[dict] = None,
) -> Mesh:
    """The Mesh of `position` in the grid; `ranks` maps positions to process ranks. `groups` maps (axis,
    members) to its process group; None builds a virtual mesh (planning: sizes and coordinates only).
    `emulate_nccl`: the pp axis sends and receives through an emulated NCCL stream (p2p_semantics.py).
    `twins`: lane 1's communicators by members (build_mesh's _twin_groups), given to the laned axes."""
    stats = CommStats()

    def axis(name: str) -> Axis:
        members = grid.group_of(name, position)
        real = tuple(ranks[i] for i in members)
        size = len(members)
        group = groups.get((name, members)) if groups is not None else None
        stream = stream_for(group, emulate_nccl) if name == "pp" else None
        return Axis(
            RankGrid.STATS.get(name, name),
            size,
            members.index(position),
            real,
            group,
            stats,
            virtual=groups is None and size > 1,
            twin=(twins or {}).get(members) if name in LANED else None,
            p2p=stream,
        )

    experts = grid.folded  # else ep and etp are of size 1 and edp is dpcp (the Mesh defaults)
    hybrid = grid.hybrid  # else dp_shard is dp (or dpcp under cp) and dp_rep of size 1 (the Mesh defaults)
    context = grid.cp > 1  # else cp is of size 1 and dpcp is dp (the Mesh defaults)
    return Mesh(
        tp=axis("tp"),
        pp=axis("pp"),
        dp=axis("dp"),
        pp_ends=axis("pp_ends"),
        rank=position,
        world=grid.world,
        device=torch.device(device),
        stats=stats,
        group=everyone,
        ep=axis("ep") if experts else None,
        edp=axis("edp") if experts else None,
        etp=axis("etp") if experts else None,
        edp_shard=axis("edp_shard") if experts and hybrid else None,
        edp_rep=axis("edp_rep") if experts and hybrid else None,
        dp_shard=axis("dp_shard") if hybrid else None,
        dp_rep=axis("dp_rep") if hybrid else None,
        cp=axis("cp") if context else None,
        dpcp=axis("dpcp") if context else None,
        ep_node=axis("ep_node") if grid.by_node else None,
        ep_rail=axis("ep_rail") if grid.by_node else None,
    )


def build_mesh(
    tp: int,
    pp: int,
    device: torch.device,
    ranks: Optional[Sequence[int]] = None,
    ep: int = 1,
    timeout: Optional[datetime.timedelta] = None,
    world_timeout: Optional[datetime.timedelta] = None,
    shard: int = 0,
    cp: int = 1,
    etp: int = 1,
    node: int = 0,
    lanes: int = 1,
) -> Mesh:
    """Create every tp/pp/dp (and ep/edp, HSDP's dp_shard/dp_rep, cp/dpcp) group over `ranks` (default:
    all). Collective: every process must call it. `shard`: optim.shard_group_size (0 or dp: no HSDP).
    `node`: ranks per node when the ep all-to-all goes by node (ep_node / ep_rail; 0: it does not).
    `lanes`: 2 gives the compute axes a twin communicator each (the overlapped pipeline kinds' second lane).

    `timeout` (train.dist_timeout_s) applies to every group: new_group does not inherit
    init_process_group's, it takes the backend's default (30 min on gloo, 10 on NCCL) unless told.
    `world_timeout`: mesh.group's, whose barriers and gathers wait for the slowest checkpoint writer
    (checkpoint.save_timeout_s). None: the backend's default.

    Processes outside `ranks` (a worker pool running a smaller job) take part in group creation and get
    back None's stand-in: they must not use the result.
    """
    initialized = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if initialized else 0
    ranks = list(ranks) if ranks is not None else list(range(dist.get_world_size() if initialized else 1))
    world = len(ranks)
    assert world % (tp * pp * cp) == 0, f"tp*pp*cp={tp * pp * cp} does not divide world {world}"
    grid = RankGrid(tp, world // (tp * pp * cp), pp, ep=ep, shard=shard, cp=cp, etp=etp, node=node)
    groups = _groups(grid, ranks, timeout, lanes) if initialized else {}
    twins = _twin_groups(grid, ranks, timeout) if lanes > 1 and initialized else {}
    # Created before the `me not in ranks` exit: processes outside the job must still join the call.
    everyone = (
        dist.new_group(ranks, timeout=world_timeout, backend="gloo") if (world > 1 and initialized) else None
    )
    if me not in ranks:
        return None  # type: ignore[return-value]
    emulate_nccl = semantics_from_env() is P2PSemantics.NCCL  # read once; the pp axis carries the mode
    return mesh_at(grid, ranks.index(me), device, ranks, groups, everyone, emulate_nccl, twins)


def _groups(grid: RankGrid, ranks: Sequence[int], timeout, lanes: int) -> dict:
    """(axis name, members) -> process group of every axis of size > 1 (REUSABLE ones over the same ranks
    share one). Collective over the whole world: every process creates every group, in one order."""
    groups: dict = {}
    made: dict = {}  # members -> (axis, group) of the data-parallel family's group already created over them
    for name in grid.creation_order():
        for members in grid.groups(name):
            if len(members) == 1:
                continue
            # e.g. ep = dp, ep = cp, dpcp = cp (dp = 1). Not a dp_shard over a cp group: its reduce-scatters
            # run during backward beside cp's attention traffic, and one communicator would serialise them.
            # Under two lanes a compute axis keeps its own communicator: the data-parallel family's
            # collectives run in a backward's hooks, beside the other lane's forward (parallel/lanes.py).
            shares = name in REUSABLE and not (lanes > 1 and name in LANED)
            if shares and members in made and not (name == "dp_shard" and made[members][0] == "cp"):
                # Reuse: a second communicator over the same ranks costs NCCL memory and init time.
                # Every process takes this branch alike, so the new_group calls below stay in step.
                groups[(name, members)] = made[members][1]
                continue
            # new_group is collective over the whole world: every process creates every group, in order
            groups[(name, members)] = dist.new_group([ranks[i] for i in members], timeout=timeout)
            if shares:
                made[members] = (name, groups[(name, members)])
    return groups


def _twin_groups(grid: RankGrid, ranks: Sequence[int], timeout) -> dict:
    """Lane 1's communicators (parallel/lanes.py): one per distinct member set of the laned axes, whose
    collectives a lane enters in program order from one thread at a time. Collective, in one order."""
    twins: dict = {}
    for name in grid.creation_order():
        if name not in LANED:
            continue
        for members in grid.groups(name):
            if len(members) > 1 and members not in twins:
                twins[members] = dist.new_group([ranks[i] for i in members], timeout=timeout)
    return twins


def single_process_mesh(device: torch.device | str = "cpu") -> Mesh:
    """The mesh of one process: every axis of size 1, no process groups."""
    return build_mesh(1, 1, torch.device(device), ranks=[dist.get_rank() if dist.is_initialized() else 0])
