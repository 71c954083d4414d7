"""How each local parameter is cut from its global tensor, and layout-free initialisation.

Every parameter carries a `Placement` (parallel/placement.py, as `param.placement`) whose `shard` is a
`Shard`: the global shape, the split dim, and the fused sub-blocks along it. A fused QKV weight of a GQA model is [q | k | v] along dim 0 with unequal sizes;
each block is split over tp separately, so rank r holds [q_r | k_r | v_r] and its heads line up.
The same description drives init (build the full tensor, keep the slice), checkpoint metadata (global
shape and every slice's offset) and reassembly of full tensors.
"""
from __future__ import annotations

import hashlib
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

    def __post_init__(self):
        if self.dim is not None:
            parts = self.parts or (self.global_shape[self.dim],)
            assert sum(parts) == self.global_shape[self.dim], (self, parts)
            assert all(p % self.size == 0 for p in parts), f"{parts} not divisible by {self.size}"
            object.__setattr__(self, "parts", tuple(parts))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] //= self.size
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
        return torch.cat([full.narrow(self.dim, g, n) for g, _, n in self.ranges(rank)], dim=self.dim)

    def place(self, full: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Write `rank`'s local slice into the full tensor (the inverse of `local`)."""
        if self.dim is None:
            full.copy_(local)
            return
        for g, l, n in self.ranges(rank):
            full.narrow(self.dim, g, n).copy_(local.narrow(self.dim, l, n))


def sharded_param(shard: Shard, device, dtype=torch.float32, tp_partial_grad: bool = False,
                  pp_tied: bool = False, pp_duplicate: bool = False) -> nn.Parameter:
    """An uninitialised parameter of the shard's local shape, with its `Placement` (the flags are its
    fields: tp_partial_grad for a tp-replicated parameter whose grad is partial on each tp rank under sp,
    pp_tied / pp_duplicate for a tied embedding's copies on the pipeline ends)."""
    p = nn.Parameter(torch.empty(shard.local_shape, device=device, dtype=dtype))
    p.placement = Placement(shard, tp_partial_grad, pp_tied, pp_duplicate)
    return p


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, global parameter name): the only inputs of init."""
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


def full_init(name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The full (global) initial tensor of a parameter, identical in every layout."""
    kind, s = init_rule(name, std, num_layers)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, s, generator=gen)


def expert_name(name: str, e: int) -> str:
    """The global name of expert e's own weight in a stacked expert parameter:
    layers.3.mlp.experts.up_proj.weight -> layers.3.mlp.experts.5.up_proj.weight."""
    return name.replace(".experts.", f".experts.{e}.", 1)


def full_init_param(name: str, shard: Shard, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """full_init, except that stacked experts ([E, ...] over ep) get one tensor per expert, each from
    (seed, the expert's own global name): the same experts whatever ep is."""
    if not shard.expert:
        return full_init(name, shard.global_shape, seed, std, num_layers)
    shape = shard.global_shape[1:]
    return torch.stack([full_init(expert_name(name, e), shape, seed, std, num_layers)
                        for e in range(shard.global_shape[0])])


@torch.no_grad()
def init_model(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Initialise every parameter from (seed, global name): build the full tensor, keep this rank's slice."""
    for name, p in model.named_parameters():
        if p.is_meta:  # a planning model: shapes only, and building a full 8B tensor would take minutes
            continue
        full = full_init_param(name, p.placement.shard, seed, std, num_layers)
        p.copy_(p.placement.shard.local(full).to(p.device, p.dtype))


def gather_full(local: torch.Tensor, shard: Shard, axis) -> torch.Tensor:
    """The full tensor from every rank's slice along `axis` (the mesh axis named by shard.axis: tp, or ep
    for experts); a plain all-gather, for tests, export and checks."""
    import torch.distributed as dist

    if shard.dim is None or axis.size == 1:
        return local.detach().clone()
    pieces = [torch.empty_like(local) for _ in range(axis.size)]
    dist.all_gather(pieces, local.detach().contiguous(), group=axis.group)
    full = torch.empty(shard.global_shape, dtype=local.dtype, device=local.device)
    for r, piece in enumerate(pieces):
        shard.place(full, piece, r)
    return full
