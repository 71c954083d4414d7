"""The process mesh: which ranks share a tensor-, pipeline- or data-parallel group, and this rank's place.

Global rank order is tp innermost, then dp, then pp outermost (Megatron's order), so a tp group is a
block of consecutive ranks and tensor-parallel traffic stays on one node:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Expert parallelism borrows its ranks from dp (Megatron's "parallel folding"): the dp group is cut into
contiguous blocks of `ep` ranks, each block an `ep` group holding all experts between them (each rank
E/ep of them); the dp ranks holding the same experts (same position in their block) form the
expert-data-parallel group `edp` (size dp/ep), over which expert grads are reduced:

    dp_rank = ep_rank + ep * edp_rank

The mesh is built once from the config and passed to every layer, the optimizer and the data loader.
Axes of size 1 carry no process group: the collectives in `comm` never communicate over them, which is
also why one process needs no torch.distributed at all.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megaframe.parallel.p2p_semantics import NcclStream, P2PSemantics, group_timeout_s, semantics_from_env

RECENT_COLLECTIVES = 64


@dataclass
class CommStats:
    """Bytes this rank sent per group, counted by the collectives in `comm` (ring-algorithm volumes),
    and the last collectives this rank entered (a ring buffer the hang watchdog dumps)."""

    sent: dict[str, int] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_COLLECTIVES))
    """dicts: op, group, ranks, shape, dtype, bytes, t (wall clock at entry), done (a blocking call
    returned, or an async one's Work was waited for), async (launched with async_op)."""

    def add(self, group: str, nbytes: float) -> None:
        self.sent[group] = self.sent.get(group, 0) + int(nbytes)

    def record(self, op: str, group: str, ranks, shape, dtype, nbytes: int) -> dict:
        """Note a collective as it is entered; entry['done'] is set once a blocking call returns (see
        `noting`) or an async one's Work is waited for (comm._done)."""
        entry = {"op": op, "group": group, "ranks": tuple(ranks), "shape": tuple(shape), "dtype": str(dtype),
                 "bytes": int(nbytes), "t": time.time(), "done": False, "async": False}
        self.recent.append(entry)
        return entry

    @contextmanager
    def noting(self, op: str, group: str, ranks, shape, dtype, nbytes: int):
        """`with stats.noting(...):` around a blocking collective: recorded on entry, done on return."""
        entry = self.record(op, group, ranks, shape, dtype, nbytes)
        yield entry
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
        assert self.size == 1 or self.group is not None or self.virtual, \
            f"axis {self.name} of size {self.size} needs a group"


@dataclass(frozen=True)
class Mesh:
    """Frozen layout of this rank: the tp, pp, dp (and ep, edp) axes, the device, and the shared byte counter."""

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
    """All ranks of this mesh (barriers, gathering checkpoint metadata); None for one process."""
    ep: Optional[Axis] = None
    """Expert-parallel axis: a contiguous block of the dp group (all-to-all of tokens); bytes count as ep."""
    edp: Optional[Axis] = None
    """Expert-data-parallel axis: dp ranks holding the same experts (expert grads, ZeRO shards of expert
    params); its bytes count as dp traffic. It is the dp axis itself when ep = 1."""

    def __post_init__(self):
        if self.ep is None:  # a mesh without expert parallelism: ep of size 1, edp = dp
            object.__setattr__(self, "ep", Axis("ep", 1, 0, (self.dp.ranks[self.dp.rank],), None, self.stats))
        if self.edp is None:
            object.__setattr__(self, "edp", self.dp)

    @property
    def is_logger(self) -> bool:
        """The one rank that writes metrics and talks to wandb: first rank of the last pipeline stage."""
        return self.tp.rank == 0 and self.dp.rank == 0 and self.pp.rank == self.pp.size - 1

    def describe(self) -> str:
        ep = f" ep={self.ep.size}" if self.ep.size > 1 else ""
        p2p = " p2p=nccl-emulated" if self.pp.p2p is not None else ""
        return (f"world={self.world} tp={self.tp.size} pp={self.pp.size} dp={self.dp.size}{ep} "
                f"device={self.device.type}{p2p}")


def build_mesh(tp: int, pp: int, device: torch.device, ranks: Optional[Sequence[int]] = None, ep: int = 1) -> Mesh:
    """Create every tp/pp/dp (and ep/edp) group over `ranks` (default: all). Collective: every process must call it.

    Processes outside `ranks` (a worker pool running a smaller job) take part in group creation and get
    back None's stand-in: they must not use the result.
    """
    initialized = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if initialized else 0
    ranks = list(ranks) if ranks is not None else list(range(dist.get_world_size() if initialized else 1))
    world = len(ranks)
    assert world % (tp * pp) == 0, f"tp*pp={tp * pp} does not divide world {world}"
    dp = world // (tp * pp)
    grid = {}  # (pp, dp, tp) coordinate -> global rank
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        grid[(p, d, t)] = ranks[t + tp * (d + dp * p)]
    stats = CommStats()
    emulate_nccl = semantics_from_env() is P2PSemantics.NCCL  # read once; the axis carries the mode
    axes: dict[str, Axis] = {}
    for name, size in (("tp", tp), ("dp", dp), ("pp", pp)):
        for members in _groups_along(grid, name, tp, pp, dp):
            group = dist.new_group(list(members)) if (size > 1 and initialized) else None
            if me in members:
                stream = NcclStream(group, group_timeout_s(group)) if name == "pp" and group is not None and emulate_nccl else None
                axes[name] = Axis(name, size, members.index(me), tuple(members), group, stats, p2p=stream)
    axes["pp_ends"] = _pp_ends_axis(me, stats, initialized and pp > 1, grid, pp, dp, tp)
    assert dp % ep == 0, f"ep={ep} does not divide dp={dp}"
    _expert_axes(axes, me, stats, initialized, grid, pp, dp, tp, ep)
    everyone = dist.new_group(ranks) if (world > 1 and initialized) else None
    if me not in ranks:
        return None  # type: ignore[return-value]
    return Mesh(tp=axes["tp"], pp=axes["pp"], dp=axes["dp"], pp_ends=axes["pp_ends"], rank=ranks.index(me),
                world=world, device=device, stats=stats, group=everyone, ep=axes.get("ep"), edp=axes.get("edp"))


def expert_groups(dp_members: Sequence[int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, edp groups) of one dp group's ranks: dp_rank = ep_rank + ep * edp_rank."""
    dp_members = list(dp_members)
    return ([dp_members[j:j + ep] for j in range(0, len(dp_members), ep)],
            [dp_members[e::ep] for e in range(ep)])


def _expert_axes(axes: dict, me, stats, initialized: bool, grid, pp, dp, tp, ep) -> None:
    """ep groups: dp ranks [j*ep, (j+1)*ep) of each dp group; edp groups: dp ranks congruent mod ep.
    Reuses the dp group where an axis spans all of dp (ep = dp: ep; ep = 1: edp)."""
    if ep == 1:
        return
    edp = dp // ep
    for p, t in itertools.product(range(pp), range(tp)):
        ep_blocks, edp_blocks = expert_groups([grid[(p, d, t)] for d in range(dp)], ep)
        for name, size, blocks in (("ep", ep, ep_blocks), ("dp", edp, edp_blocks)):
            for members in blocks:
                if size == dp and me in members:
                    group = axes["dp"].group  # this axis is the whole dp group
                else:
                    group = dist.new_group(members) if (size > 1 and initialized and size != dp) else None
                if me in members:
                    axes["ep" if name == "ep" else "edp"] = Axis(name, size, members.index(me), tuple(members),
                                                                  group, stats)


def _pp_ends_axis(me, stats, make_groups: bool, grid, pp, dp, tp) -> Axis | None:
    """The group {first, last} pipeline rank for every (dp, tp); its bytes count as pp traffic."""
    mine = None
    for d, t in itertools.product(range(dp), range(tp)):
        members = (grid[(0, d, t)], grid[(pp - 1, d, t)])
        group = dist.new_group(list(members)) if make_groups else None
        if me in members and pp > 1:
            mine = Axis("pp", 2, members.index(me), members, group, stats)
    if mine is None:
        mine = Axis("pp", 1, 0, (me,), None, stats)
    return mine


def _groups_along(grid: dict, name: str, tp: int, pp: int, dp: int) -> list[tuple[int, ...]]:
    """Groups varying along axis `name` with the other two coordinates fixed, in a fixed global order."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    order = ("pp", "dp", "tp")
    others = [a for a in order if a != name]
    out = []
    for fixed in itertools.product(*(range(sizes[a]) for a in others)):
        coord = dict(zip(others, fixed))
        members = []
        for i in range(sizes[name]):
            coord[name] = i
            members.append(grid[(coord["pp"], coord["dp"], coord["tp"])])
        out.append(tuple(members))
    return out


def single_process_mesh(device: torch.device | str = "cpu") -> Mesh:
    """The mesh of one process: every axis of size 1, no process groups."""
    return build_mesh(1, 1, torch.device(device), ranks=[dist.get_rank() if dist.is_initialized() else 0])
