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

Expert parallelism borrows its ranks from cp·dp (Megatron's "parallel folding"; Megatron also requires
ep to divide cp·dp): the dpcp group is cut into contiguous blocks of `ep` ranks, each block an `ep` group
holding all experts between them (each rank E/ep of them); the dpcp ranks holding the same experts (same
position in their block) form the expert-data-parallel group `edp` (size cp·dp/ep), over which expert
grads are reduced (every cp and dp rank routes its own tokens, so expert grads are partial over both):

    dpcp_rank = cp_rank + cp * dp_rank = ep_rank + ep * edp_rank

Contiguous blocks put an ep group inside a cp group first (ep <= cp: the ep ranks are cp peers) and
only then across dp: the token all-to-all runs twice per layer and direction, so it takes the ranks
nearest in the rank order (same node), like cp's own K/V traffic; the edp reduction runs once a step.
With cp = 1 this is the dp group cut as before.

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
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megaframe.parallel.p2p_semantics import NcclStream, P2PSemantics, semantics_from_env, stream_for

RECENT_COLLECTIVES = 64
REUSABLE = ("dp", "cp", "dpcp", "ep", "edp", "dp_shard", "dp_rep")
"""Axes whose collectives are all-reduces, gathers and all-to-alls of whole groups (never p2p): one of them
over the same ranks as another shares its process group (tp, pp and pp_ends keep their own)."""


@dataclass
class CommStats:
    """Bytes this rank sent per group, counted by the collectives in `comm` (ring-algorithm volumes),
    and the last collectives this rank entered (a ring buffer the hang watchdog dumps)."""

    sent: dict[str, int] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_COLLECTIVES))
    """dicts: op, group, ranks, shape, dtype, bytes, t (wall clock at entry), done (a blocking call
    returned, or an async one's Work was waited for), async (launched with async_op), event (device
    collectives: a CUDA event recorded once done, see `returned`)."""

    events: list = field(default_factory=list)
    """CUDA events, reused round-robin (one per ring-buffer slot), that tell whether a device
    collective's work has finished on its stream."""

    def returned(self, entry: dict, on_device: bool = False) -> None:
        """The host call of a collective returned (blocking) or its Work was waited for (async). On
        CUDA neither means it ran: NCCL only enqueued it on a stream. So for device tensors an event
        is recorded on the current stream (after the collective, or after the stream's wait on its
        Work); the watchdog's report queries it (completed vs enqueued). No host sync."""
        entry["done"] = True
        if on_device:
            # A fixed pool, not an event per collective: thousands of calls a step would each allocate one;
            # an event is only overwritten after RECENT_COLLECTIVES newer entries, when its entry left the
            # ring.
            if len(self.events) < RECENT_COLLECTIVES:
                self.events.append(torch.cuda.Event())
            event = self.events[self._next_event % RECENT_COLLECTIVES]
            self._next_event += 1
            event.record()
            entry["event"] = event

    _next_event: int = 0
    observer: object = None  # parallel/observe.py's Observer: holds in collectives, profiler ranges

    def add(self, group: str, nbytes: float) -> None:
        self.sent[group] = self.sent.get(group, 0) + int(nbytes)

    def record(self, op: str, group: str, ranks, shape, dtype, nbytes: int) -> dict:
        """Note a collective as it is entered; entry['done'] is set once a blocking call returns (see
        `noting`) or an async one's Work is waited for (comm._done)."""
        entry = {
            "op": op,
            "group": group,
            "ranks": tuple(ranks),
            "shape": tuple(shape),
            "dtype": str(dtype),
            "bytes": int(nbytes),
            "t": time.time(),
            "done": False,
            "async": False,
        }
        self.recent.append(entry)
        return entry

    @contextmanager
    def noting(self, op: str, group: str, ranks, shape, dtype, nbytes: int):
        """`with stats.noting(...):` around a blocking collective: recorded on entry, done on return."""
        entry = self.record(op, group, ranks, shape, dtype, nbytes)
        yield entry
        # Not in a finally: a collective that raised did not complete, and the dump should say so.
        entry["done"] = True

    def last(self, n: int = RECENT_COLLECTIVES) -> list[dict]:
        """The newest n entries, oldest first (safe to call from another thread)."""
        for _ in range(10):  # the main thread may append while we copy
            try:
                return list(self.recent)[-n:]
            except RuntimeError:
                continue
        return []

    def pop(self) -> dict[str, int]:
        # Swap, not clear: the caller keeps the dict it got while later collectives count into a new one.
        out, self.sent = self.sent, {}
        return out


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
    """Expert-parallel axis: a contiguous block of the dpcp
    group (all-to-all of tokens); bytes count as ep."""
    edp: Optional[Axis] = None
    """Expert-data-parallel axis: cp·dp ranks holding the same experts (expert grads, ZeRO shards of expert
    params); its bytes count as dp traffic. It is the dpcp axis itself when ep = 1."""
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
            object.__setattr__(
                self, "dp_rep", Axis("dp", 1, 0, (self.dp.ranks[self.dp.rank],), None, self.stats)
            )

    @property
    def is_logger(self) -> bool:
        """The one rank that writes metrics and talks to wandb: first rank of the last pipeline stage."""
        return (
            self.tp.rank == 0 and self.cp.rank == 0 and self.dp.rank == 0 and self.pp.rank == self.pp.size - 1
        )

    def describe(self) -> str:
        ep = f" ep={self.ep.size}" if self.ep.size > 1 else ""
        p2p = " p2p=nccl-emulated" if self.pp.p2p is not None else ""
        cp = f" cp={self.cp.size}" if self.cp.size > 1 else ""
        return (
            f"world={self.world} tp={self.tp.size}{cp} pp={self.pp.size} dp={self.dp.size}{ep} "
            f"device={self.device.type}{p2p}"
        )


@dataclass(frozen=True)
class RankGrid:
    """The rank arithmetic of a layout: the one place that knows the axis order and group membership.
    build_mesh creates a process group per group listed here; virtual_mesh (planning) reads the same
    membership without groups. Positions are 0..world-1; build_mesh maps them to process ranks.

        position = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
        dpcp_rank = cp_rank + cp * dp_rank = ep_rank + ep * edp_rank = shard_rank + shard * rep_rank
    """

    tp: int
    dp: int
    pp: int
    ep: int = 1
    shard: int = 0
    """HSDP shard group size (dp_shard), out of the cp·dp ranks; 0 means cp·dp (no replication across
    shard groups)."""
    cp: int = 1
    """Context-parallel size (between tp and dp in the rank order)."""

    AXES = ("tp", "dp", "pp", "pp_ends", "ep", "edp", "dp_shard", "dp_rep", "cp", "dpcp")
    STATS = {"pp_ends": "pp", "edp": "dp", "dp_shard": "dp", "dp_rep": "dp", "dpcp": "dp"}
    """The byte counter of an axis, where it is not its own name (an Axis's `name`)."""

    def __post_init__(self):
        # Uneven blocks would give ranks different expert counts and edp groups of different sizes.
        assert self.cp * self.dp % self.ep == 0, f"ep={self.ep} does not divide cp·dp={self.cp * self.dp}"
        if not self.shard:
            object.__setattr__(self, "shard", self.cp * self.dp)
        assert self.cp * self.dp % self.shard == 0, (
            f"shard group size {self.shard} does not divide cp·dp={self.cp * self.dp}"
        )

    @property
    def hybrid(self) -> bool:
        """Whether cp·dp is cut into HSDP shard groups (then dp_shard and dp_rep get their own groups)."""
        return self.shard < self.cp * self.dp

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def position(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group of axis `name`, in one fixed order (every process creates them in this order)."""
        at, tp, dp, pp, ep, cp = self.position, self.tp, self.dp, self.pp, self.ep, self.cp
        ctp = [(c, t) for c in range(cp) for t in range(tp)]
        dp_groups = [tuple(at(p, d, t, c) for d in range(dp)) for p in range(pp) for c, t in ctp]
        # ordered by position: dpcp_rank = cp_rank + cp * dp_rank (with cp = 1 the dp groups, in their order)
        dpcp_groups = [
            tuple(at(p, d, t, c) for d in range(dp) for c in range(cp)) for p in range(pp) for t in range(tp)
        ]
        if name == "tp":
            return [
                tuple(at(p, d, t, c) for t in range(tp))
                for p in range(pp)
                for d in range(dp)
                for c in range(cp)
            ]
        if name == "dp":
            return dp_groups
        if name == "cp":
            return [
                tuple(at(p, d, t, c) for c in range(cp))
                for p in range(pp)
                for d in range(dp)
                for t in range(tp)
            ]
        if name == "dpcp":
            return dpcp_groups
        if name == "pp":
            return [tuple(at(p, d, t, c) for p in range(pp)) for d in range(dp) for c, t in ctp]
        if name == "pp_ends":  # first and last pipeline rank: the tied embedding's two copies
            return (
                [(at(0, d, t, c), at(pp - 1, d, t, c)) for d in range(dp) for c, t in ctp] if pp > 1 else []
            )
        if name == "ep":  # contiguous blocks of ep cp·dp ranks, each holding all experts between them
            return [g[j : j + ep] for g in dpcp_groups for j in range(0, cp * dp, ep)]
        if name == "edp":  # the cp·dp ranks holding the same experts: same position in their ep block
            return [g[e::ep] for g in dpcp_groups for e in range(ep)]
        if name == "dp_shard":  # HSDP: blocks of `shard` consecutive cp·dp ranks
            return [g[j : j + self.shard] for g in dpcp_groups for j in range(0, cp * dp, self.shard)]
        if name == "dp_rep":  # HSDP: the cp·dp ranks at the same position of their shard block
            return [g[e :: self.shard] for g in dpcp_groups for e in range(self.shard)]
        raise KeyError(name)

    def group_of(self, name: str, position: int) -> tuple[int, ...]:
        """The group of axis `name` holding `position`
        (just itself where it has none: off the pipeline ends)."""
        # A linear scan over every group: called once per axis at start-up, never in a step.
        return next((g for g in self.groups(name) if position in g), (position,))


def mesh_at(
    grid: RankGrid,
    position: int,
    device,
    ranks: Sequence[int],
    groups: Optional[dict] = None,
    everyone=None,
    emulate_nccl: bool = False,
) -> Mesh:
    """The Mesh of `position` in the grid; `ranks` maps positions to process ranks. `groups` maps (axis,
    members) to its process group; None builds a virtual mesh (planning: sizes and coordinates only).
    `emulate_nccl`: the pp axis sends and receives through an emulated NCCL stream (p2p_semantics.py)."""
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
            p2p=stream,
        )

    experts = grid.ep > 1  # else ep is of size 1 and edp is dp (the Mesh defaults)
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
        dp_shard=axis("dp_shard") if hybrid else None,
        dp_rep=axis("dp_rep") if hybrid else None,
        cp=axis("cp") if context else None,
        dpcp=axis("dpcp") if context else None,
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
) -> Mesh:
    """Create every tp/pp/dp (and ep/edp, HSDP's dp_shard/dp_rep, cp/dpcp) group over `ranks` (default:
    all). Collective: every process must call it. `shard`: optim.shard_group_size (0 or dp: no HSDP).

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
    grid = RankGrid(tp, world // (tp * pp * cp), pp, ep=ep, shard=shard, cp=cp)
    groups: dict = {}
    # cp and dpcp before ep and edp: an ep group may be a whole cp or dpcp group, and then reuses it
    names = (
        RankGrid.AXES[:4]
        + (("cp", "dpcp") if cp > 1 else ())
        + (("ep", "edp") if ep > 1 else ())
        + (("dp_shard", "dp_rep") if grid.hybrid else ())
    )
    made: dict = {}  # members -> (axis, group) of the data-parallel family's group already created over them
    for name in names:
        for members in grid.groups(name):
            if len(members) == 1 or not initialized:
                continue
            # e.g. ep = dp, ep = cp, dpcp = cp (dp = 1). Not a dp_shard over a cp group: its reduce-scatters
            # run during backward beside cp's attention traffic, and one communicator would serialise them.
            if name in REUSABLE and members in made and not (name == "dp_shard" and made[members][0] == "cp"):
                # Reuse: a second communicator over the same ranks costs NCCL memory and init time.
                # Every process takes this branch alike, so the new_group calls below stay in step.
                groups[(name, members)] = made[members][1]
                continue
            # new_group is collective over the whole world: every process creates every group, in order
            groups[(name, members)] = dist.new_group([ranks[i] for i in members], timeout=timeout)
            if name in REUSABLE:
                made[members] = (name, groups[(name, members)])
    # Created before the `me not in ranks` exit: processes outside the job must still join the call.
    everyone = (
        dist.new_group(ranks, timeout=world_timeout, backend="gloo") if (world > 1 and initialized) else None
    )
    if me not in ranks:
        return None  # type: ignore[return-value]
    emulate_nccl = semantics_from_env() is P2PSemantics.NCCL  # read once; the pp axis carries the mode
    return mesh_at(grid, ranks.index(me), device, ranks, groups, everyone, emulate_nccl)


def single_process_mesh(device: torch.device | str = "cpu") -> Mesh:
    """The mesh of one process: every axis of size 1, no process groups."""
    return build_mesh(1, 1, torch.device(device), ranks=[dist.get_rank() if dist.is_initialized() else 0])
