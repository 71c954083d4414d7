"""How each local parameter is cut from its global tensor, and layout-free initialisation.

Every parameter carries a `Placement` (parallel/placement.py, as `param.placement`) whose `shard` is a
`Shard`: the global shape, the split dim, and the fused sub-blocks along it. A fused QKV weight of a GQA model
is [q | k | v] along dim 0 with unequal sizes;
each block is split over tp separately, so rank r holds [q_r | k_r | v_r] and its heads line up.
The same description drives init (each rank draws only the fixed blocks of the global tensor its slice
touches, each block from a seed of (seed, name, block)), checkpoint metadata (global shape and every
slice's offset) and reassembly of full tensors.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megaframe.parallel.placement import Placement


@dataclass(frozen=True)
class Shard:
    """Split of a global tensor over `size` ranks along `dim` (None: replicated), block by block.

    `axis` names the mesh axis of the split: "tp" (tensor-parallel layers) or "ep" (experts stacked
    along dim 0, split over expert parallelism and replicated over tp)."""

    global_shape: tuple[int, ...]
    dim: Optional[int] = None
    parts: tuple[int, ...] = ()
    rank: int = 0
    size: int = 1
    axis: str = "tp"
    inner: Optional["Shard"] = None
    """A second split of the same global tensor along another dim, applied to this one's slice: stacked
    experts' own tensor parallelism (axis "etp": each expert's rows or columns over parallel.etp)."""

    def __post_init__(self):
        if self.dim is not None:
            parts = self.parts or (self.global_shape[self.dim],)
            assert sum(parts) == self.global_shape[self.dim], (self, parts)
            # Each fused block is split separately, so each must
            # divide: rank r's q, k and v heads must line up.
            assert all(p % self.size == 0 for p in parts), f"{parts} not divisible by {self.size}"
            object.__setattr__(self, "parts", tuple(parts))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] //= self.size
        if self.inner is not None:
            shape[self.inner.dim] //= self.inner.size
        return tuple(shape)

    def ranges(self, rank: Optional[int] = None) -> list[tuple[int, int, int]]:
        """(global offset, local offset, length) along `dim` of each block held by `rank`."""
        rank = self.rank if rank is None else rank
        out, g_off, l_off = [], 0, 0
        for p in self.parts:
            n = p // self.size
            out.append((g_off + rank * n, l_off, n))
            g_off += p
            l_off += n
        return out

    @property
    def expert(self) -> bool:
        """Expert weights: split over ep, reduced and ZeRO-sharded over edp instead of dp."""
        return self.axis == "ep"

    def local(self, full: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """This rank's slice of the full tensor."""
        if self.dim is None:
            return full
        mine = torch.cat([full.narrow(self.dim, g, n) for g, _, n in self.ranges(rank)], dim=self.dim)
        # the inner split's dim is still whole in `mine`: its global offsets index it directly
        return mine if self.inner is None else self.inner.local(mine)

    def place(self, full: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Write `rank`'s local slice into the full tensor (the inverse of `local`)."""
        if self.dim is None:
            full.copy_(local)
            return
        for g, l, n in self.ranges(rank):
            full.narrow(self.dim, g, n).copy_(local.narrow(self.dim, l, n))


def sharded_param(
    shard: Shard,
    device,
    dtype=torch.float32,
    tp_partial_grad: bool = False,
    pp_tied: bool = False,
    pp_duplicate: bool = False,
    role: str = "hidden",
    expert_rows: tuple[int, ...] = (),
    expert_folded: bool = False,
) -> nn.Parameter:
    """An uninitialised parameter of the shard's local shape, with its `Placement` (the flags are its
    fields: tp_partial_grad for a tp-replicated parameter whose grad is partial on each tp rank under sp,
    pp_tied / pp_duplicate for a tied embedding's copies on the pipeline ends, role and expert_rows for
    the update rule, expert_folded for experts on the folded grid: Placement's fields)."""
    p = nn.Parameter(torch.empty(shard.local_shape, device=device, dtype=dtype))
    p.placement = Placement(shard, tp_partial_grad, pp_tied, pp_duplicate, role, expert_rows, expert_folded)
    return p


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, global parameter name): the only inputs of init."""
    # sha256, not hash(): Python's str hash is salted per process, and every rank must derive the same seed.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_rule(name: str, std: float, num_layers: int) -> tuple[str, float]:
    """('normal', std) | ('ones', 0) | ('zeros', 0) from the parameter's global name."""
    if name.endswith(".bias"):
        return "zeros", 0.0
    owner = name.split(".")[-2] if "." in name else ""
    if "norm" in owner:
        return "ones", 0.0
    if name.endswith(("out_proj.weight", "down_proj.weight")):
        return "normal", std / math.sqrt(2 * num_layers)  # GPT-2 scaled init of residual outputs
    return "normal", std


BLOCK_EDGE = 256  # init block: 256 x 256 of the last two dims (one row of earlier dims)
BLOCK_1D = 1 << 16
_M64 = (1 << 64) - 1


def block_edges(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Edge of an init block along each dim: the unit a rank draws (a slice draws the blocks it touches)."""
    if len(shape) == 1:
        return (BLOCK_1D,)
    return (1,) * (len(shape) - 2) + (BLOCK_EDGE, BLOCK_EDGE)


def block_seed(base: int, index: int) -> int:
    """A 63-bit seed for block `index` of the parameter seeded `base` (splitmix64's finaliser: cheap, and
    no two blocks of a tensor share a stream)."""
    # Masked to 64 bits after every step: Python ints do not wrap, the reference splitmix64 does.
    x = (base + (index + 1) * 0x9E3779B97F4A7C15) & _M64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def init_region(
    name: str,
    shape: tuple[int, ...],
    region: list[tuple[int, int]],
    seed: int,
    std: float,
    num_layers: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [lo, hi) box `region` (one pair per dim) of a parameter's global initial tensor.

    The tensor is cut into fixed blocks (block_edges), block b drawn from its own generator seeded by
    (seed, name, b): a value depends only on (seed, name, position), whatever box is asked for, so any
    layout gets the same numbers while drawing only the blocks its slice touches. `out`: the tensor of the
    region's size to draw into (a caller's slice: no region-sized copy on the way), else a new fp32 one."""
    kind, s = init_rule(name, std, num_layers)
    size = [hi - lo for lo, hi in region]
    out = torch.empty(size) if out is None else out
    if kind != "normal":
        # Constant inits draw nothing: no generator to keep in step across layouts.
        return out.fill_(1.0 if kind == "ones" else 0.0)
    edges, base = block_edges(shape), param_seed(seed, name)
    grid = [(n + e - 1) // e for n, e in zip(shape, edges)]
    spans = [range(lo // e, (hi - 1) // e + 1) for (lo, hi), e in zip(region, edges)]
    for b in itertools.product(*spans):
        box = [(i * e, min((i + 1) * e, n)) for i, e, n in zip(b, edges, shape)]
        gen = torch.Generator().manual_seed(block_seed(base, _ravel(b, grid)))
        # The whole block is drawn even when the region takes a corner of it: a generator's stream is
        # positional, so drawing fewer values would change which value lands where.
        block = torch.empty([hi - lo for lo, hi in box]).normal_(0.0, s, generator=gen)
        src, dst = block, out
        for d, ((blo, bhi), (rlo, rhi)) in enumerate(zip(box, region)):
            lo, hi = max(blo, rlo), min(bhi, rhi)
            src, dst = src.narrow(d, lo - blo, hi - lo), dst.narrow(d, lo - rlo, hi - lo)
        dst.copy_(src)
        del block, src  # freed before the next block is drawn: one block's scratch at a time, not two
    return out


def _ravel(index: tuple[int, ...], grid: list[int]) -> int:
    flat = 0
    for i, n in zip(index, grid):
        flat = flat * n + i
    return flat


def full_init(name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The full (global) initial tensor of a parameter, identical in every layout (tests, references)."""
    return init_region(name, tuple(shape), [(0, n) for n in shape], seed, std, num_layers)


def expert_name(name: str, e: int) -> str:
    """The global name of expert e's own weight in a stacked expert parameter:
    layers.3.mlp.experts.up_proj.weight -> layers.3.mlp.experts.5.up_proj.weight."""
    return name.replace(".experts.", f".experts.{e}.", 1)


def full_init_param(name: str, shard: Shard, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The full initial tensor of a parameter (stacked experts: each expert from its own global name)."""
    whole = Shard(shard.global_shape, 0, (), 0, 1, "ep") if shard.expert else Shard(shard.global_shape)
    return local_init(name, whole, seed, std, num_layers)


def local_init(
    name: str, shard: Shard, seed: int, std: float, num_layers: int, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """This rank's slice of the parameter's global initial tensor, drawing only the blocks it touches;
    `rows` = (lo, hi): only those rows (dim 0) of the local slice (ZeRO-3 materialises its segments).
    Stacked experts ([E, ...] over ep) get one tensor per expert, each from (seed, the expert's own
    global name): the same experts whatever ep is."""
    shape, local = shard.global_shape, shard.local_shape
    r0, r1 = rows if rows is not None else (0, local[0])
    out = torch.empty((r1 - r0, *local[1:]))
    if shard.expert:
        experts = [e for g, _, n in _ranges(shard) for e in range(g, g + n)][r0:r1]
        # under etp each expert's own slice: the inner split's blocks of the expert's matrix
        inner = shard.inner.ranges() if shard.inner is not None else [(0, 0, None)]
        for i, e in enumerate(experts):
            for g, lo, n in inner:
                region, dst = [(0, m) for m in shape[1:]], out[i]
                if n is not None:
                    region[shard.inner.dim - 1] = (g, g + n)
                    dst = dst.narrow(shard.inner.dim - 1, lo, n)
                init_region(expert_name(name, e), shape[1:], region, seed, std, num_layers, out=dst)
        return out
    for g, lo, n in _ranges(shard):
        region = [(0, size) for size in shape]
        region[0] = (r0, r1)  # dim 0 is not split (else the branch below): local rows are global rows
        dst = out
        if shard.dim == 0:  # this block's local rows [lo, lo + n), clipped to the rows asked for
            a, b = max(lo, r0), min(lo + n, r1)
            if a >= b:
                continue
            region[0] = (g + a - lo, g + b - lo)
            dst = out.narrow(0, a - r0, b - a)
        elif shard.dim is not None:
            region[shard.dim] = (g, g + n)
            dst = out.narrow(shard.dim, lo, n)
        init_region(name, shape, region, seed, std, num_layers, out=dst)
    return out


def init_flat(name: str, shard: Shard, init: "InitSpec", lo: int, n: int) -> torch.Tensor:
    """Elements [lo, lo + n) of the flattened local initial tensor (a ZeRO segment), in fp32: only the
    rows the range touches are drawn, so a rank's segments cost about their own size."""
    inner = math.prod(shard.local_shape[1:])
    r0, r1 = lo // inner, -(-(lo + n) // inner)
    rows = local_init(name, shard, init.seed, init.std, init.num_layers, (r0, r1)).reshape(-1)
    return rows[lo - r0 * inner : lo - r0 * inner + n]


@dataclass(frozen=True)
class InitSpec:
    """What a parameter's initial values depend on besides its name and shard (see init_region)."""

    seed: int
    std: float
    num_layers: int


def materialize(p: nn.Parameter, data: torch.Tensor) -> None:
    """Give a storage-less (meta) parameter its tensor, in place: the Parameter object (held by its
    module, tied uses and hooks) stays the same, and keeps its placement."""
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    new.placement = p.placement
    # swap, not .data =: set_data refuses to move a tensor off the meta device
    torch.utils.swap_tensors(p, new)


def _ranges(shard: Shard) -> list[tuple[int, int, int]]:
    return [(0, 0, 0)] if shard.dim is None else shard.ranges()


@torch.no_grad()
def init_model(model: nn.Module, seed: int, std: float, num_layers: int, device=None, dtype=None) -> None:
    """Initialise every parameter from (seed, global name, position): each rank draws its slice only.
    Meta parameters are skipped, unless `device` is given: then each gets its tensor there, in `dtype`
    (the run's), drawn straight into it (no fp32 copy of the model first)."""
    for name, p in model.named_parameters():
        if p.is_meta and device is None:  # a planning model: shapes only
            continue
        # Drawn in fp32 on the CPU and then cast: the values must not depend on the device's RNG or dtype.
        local = local_init(name, p.placement.shard, seed, std, num_layers)
        if p.is_meta:
            materialize(p, local.to(device, dtype or p.dtype))
        else:
            p.copy_(local.to(p.device, p.dtype))


def gather_full(local: torch.Tensor, shard: Shard, axis, inner_axis=None) -> torch.Tensor:
    """The full tensor from every rank's slice along `axis` (the mesh axis named by shard.axis: tp, or ep
    for experts; `inner_axis`: etp, for experts split by shard.inner); a plain all-gather (through comm,
    so it is counted), for tests, export and checks."""
    from megaframe.parallel import comm

    if shard.inner is not None and inner_axis is not None and inner_axis.size > 1:
        parts = comm.all_gather_dim0(local.detach().reshape(1, *local.shape), inner_axis)
        mid_shape = list(local.shape)
        mid_shape[shard.inner.dim] = shard.global_shape[shard.inner.dim]
        mid = torch.empty(mid_shape, dtype=local.dtype, device=local.device)
        for r in range(inner_axis.size):
            shard.inner.place(mid, parts[r], r)
        local = mid
    if shard.dim is None or axis.size == 1:
        return local.detach().clone()
    # A leading dim of 1 so the dim-0 gather stacks whole slices; fused blocks are then placed one by one.
    pieces = comm.all_gather_dim0(local.detach().reshape(1, *local.shape), axis)
    full = torch.empty(shard.global_shape, dtype=local.dtype, device=local.device)
    for r in range(axis.size):
        shard.place(full, pieces[r], r)
    return full
