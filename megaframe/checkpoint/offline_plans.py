"""Checkpoint layouts without hardware: the metadata every rank of a layout would write, and the read
plan of every rank of another layout, from meta models (no tensor data). Used by the planner test and
benchmarks/bench_checkpoint.py to show plans at 256 ranks in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.checkpoint.layout import Item, my_writes, param_items, share_bytes
from megaframe.config.schema import OptimConfig
from megaframe.optim.rule_registry import rule_named
from megaframe.optim.update_rule import STATE_DTYPES
from megaframe.optim.zero_state import flat_buffers
from megaframe.parallel.virtual import virtual_mesh


class PlannedZero:
    """The optimizer interface checkpoints use (state_segments), with ZeRO's real segment layout and no
    state: what a rank's ZeroOptimizer would hold, computed on a meta model."""

    def __init__(self, model, o: OptimConfig, mesh):
        params = [p for p in model.parameters() if p.requires_grad]
        self.segs = {}
        for buf in flat_buffers(params, o, mesh):
            # the rule's state in its dtype, and an fp32 master only for sub-fp32 params (bf16), as the real
            # ZeroOptimizer keeps (empty meta tensors: the layout reads their dtype only)
            # (of the names each param's kind holds: rule.states_for)
            rule, master = rule_named(o.name), buf.dtype.is_floating_point and buf.dtype.itemsize < 4
            for s in buf.segments:
                kinds = {k: STATE_DTYPES[o.state_dtype] for k in rule.states_for(s.param.placement)}
                if master:
                    kinds["master"] = torch.float32
                views = {k: torch.empty(0, dtype=dt, device="meta") for k, dt in kinds.items()}
                self.segs.setdefault(s.param, []).append((s.param_lo, s.numel, views))

    def state_segments(self, p):
        return self.segs.get(p, [])


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp  # ep is carved out of dp, not an axis of its own

    def coords(self):
        """(pp rank, dp rank, tp rank) of every rank, in Megatron's rank order (tp innermost)."""
        return [(p, d, t) for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]


def rank_items(cfg, layout: Layout, models: dict, p: int, d: int, t: int) -> list[Item]:
    """The items of rank (p, d, t): its model (built once per (pp, tp, ep rank), on meta) and its ZeRO
    segments (zero=1) or whole moments (zero=0)."""
    from megaframe.model.parallelize import build_model_for

    mesh = virtual_mesh(layout.tp, layout.pp, layout.dp, t, p, d, device="meta", ep=layout.ep)
    # dp replicas hold the same shapes: one meta model per (pp, tp, ep) rank keeps a 256-rank plan cheap
    key = (p, t, mesh.ep.rank)
    if key not in models:
        models[key] = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    model = models[key]
    opt = (
        PlannedZero(model, cfg.optim, mesh)
        if cfg.optim.zero
        else _PlainMeta(rule_named(cfg.optim.name), STATE_DTYPES[cfg.optim.state_dtype])
    )
    return param_items(model, opt, mesh, with_sources=False)


class _PlainMeta:
    """zero=0: every dp rank holds its whole local state of the rule."""

    def __init__(self, rule, dtype):
        self.rule, self.dtype = rule, dtype

    def logical_state(self, p):
        names = self.rule.states_for(p.placement)
        return {k: torch.empty(p.shape, dtype=self.dtype, device="meta") for k in names}


def saved_metadata(cfg, layout: Layout) -> tuple[dict, dict[int, int]]:
    """(tensors of metadata.json, bytes each rank writes) for a checkpoint saved under `layout`."""
    models: dict = {}
    tensors: dict[str, dict] = {}
    written: dict[int, int] = {}
    for rank, (p, d, t) in enumerate(layout.coords()):
        name = f"shard_{rank:05d}.safetensors"
        items = rank_items(cfg, layout, models, p, d, t)
        size = {it.key: it.itemsize for it in items}
        written[rank] = 0
        for s in my_writes(items):
            e = tensors.setdefault(
                s.key, {"global_shape": list(s.global_shape), "dtype": s.dtype, "shards": []}
            )
            e["shards"].append(
                {
                    "file": name,
                    "key": s.stored_key,
                    "shape": list(s.shape),
                    "pieces": [[list(map(list, a)), list(map(list, b))] for a, b in s.pieces],
                }
            )
            written[rank] += (s.hi - s.lo) * size[s.key]
    return tensors, written


def load_needs(cfg, layout: Layout):
    """(rank, its items, its share in bytes) for every rank of a loading layout."""
    models: dict = {}
    for rank, (p, d, t) in enumerate(layout.coords()):
        items = rank_items(cfg, layout, models, p, d, t)
        yield rank, items, share_bytes(items)
