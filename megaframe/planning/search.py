"""Layout search: every valid (tp, cp, pp, vpp, dp, ep, ZeRO, micro-batch, recompute) of a model on N devices,
sized, timed by a stated model, ranked. cp is searched with the config's parallel.cp_comm.

Memory of the largest rank (first or last pipeline stage): parameters counted from the dims per stage;
grads and optimizer state as the ZeRO optimizer lays them out (estimate.state_bytes' rules without the
bucket padding); activations per micro-batch from meta-device forwards at this tp / sp / recompute
(planning.activations: the bytes of a
block, of the embedding and of the head + loss, on the rank's S/cp tokens), times the micro-batch size,
walked through the rank's own schedule (peak in flight); ZeRO shards over cp·dp.

Step time: the stated model of planning.timing (compute, each axis's communication, the bubble).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from megaframe.config import Config, ConfigError, validate
from megaframe.planning.devices import Device
from megaframe.planning.layout import Layout, cp_ring, layout_config, stage_params
from megaframe.planning.timing import step_time

__all__ = ["Estimate", "Layout", "candidates", "layout_config", "memory", "search", "stage_params", "step_time",
           "why_slower"]

RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
HEADROOM = 0.9
"""Fraction of the device memory a layout may fill."""


@dataclass
class Estimate:
    layout: Layout
    memory_bytes: int
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, tp, ep, pp, dp, bubble (the bubble's share of the stretched time)."""

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, world: int, per_node: int) -> list[Layout]:
    """Every layout validate() accepts: tp within a node, pp dividing the layers, sp wherever tp > 1."""
    m, out = cfg.model, []
    # bf16 params need ZeRO's fp32 master weights and grad buffer: zero=0 builds for fp32 only
    zeros = (1,) if cfg.train.precision == "bf16" else (0, 1)
    # tp within a node: its per-block all-reduces need the intra-node links
    for tp, cp in [(t, c) for t in divisors(world) if t <= max(per_node, 1) for c in divisors(world // t)]:
        for pp in [p for p in divisors(world // (tp * cp)) if m.num_layers % p == 0]:
            dp = world // (tp * cp * pp)
            for vpp in ([1] if pp == 1 else [v for v in (1, 2, 4) if m.num_layers % (pp * v) == 0]):
                # ep borrows its ranks from cp·dp
                for ep in ([e for e in divisors(dp * cp) if m.num_experts % e == 0] if m.num_experts else [1]):
                    for zero in zeros:
                        for mb in MICRO_BATCHES:
                            for rc in RECOMPUTE:
                                lay = Layout(tp, pp, vpp, dp, ep, zero, mb, rc, cp)
                                try:
                                    validate(layout_config(cfg, lay), world, check_data=False)
                                except ConfigError:
                                    continue
                                out.append(lay)
    return out


@functools.lru_cache(maxsize=None)
def _act_per_layer(cfg_key, tp: int, recompute: str, cp: int = 1) -> tuple[int, int, int]:
    """(bytes per block, embedding extra, head + loss extra) a micro-batch of 1 saves, from meta forwards of
    a 1- and a 2-layer model and of the two stages of a 2-layer, pp=2 model."""
    from megaframe.model.gpt import build_model
    from megaframe.optim.build import cast_model
    from megaframe.parallel.virtual import virtual_mesh
    from megaframe.planning.activations import chunk_activation_bytes

    cfg = _CFGS[cfg_key]

    def measure(layers: int, pp: int, pp_rank: int) -> int:
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers),
                                parallel=dataclasses.replace(cfg.parallel, tp=tp, pp=pp, vpp=1, ep=1, sp=tp > 1,
                                                             pp_layout=None, cp=cp),
                                train=dataclasses.replace(cfg.train, recompute=recompute, compile=False))
        mesh = virtual_mesh(tp, pp, 1, pp_rank=pp_rank, device="meta", cp=cp)
        return chunk_activation_bytes(cast_model(build_model(c, mesh), c.train.precision), 0, 1, fused_attention=True)

    # a 2-layer minus a 1-layer model: one block's bytes, the embedding and head cancel out
    per_layer = measure(2, 1, 0) - measure(1, 1, 0)
    return per_layer, measure(2, 2, 0) - per_layer, measure(2, 2, 1) - per_layer


_CFGS: dict[int, Config] = {}


@functools.lru_cache(maxsize=None)
def _peak_inflight(kind: str, pp: int, vpp: int, m: int, rank: int, chunk_bytes: tuple) -> int:
    from megaframe.pipeline.schedule import compute_order
    from megaframe.planning.estimate import peak_activations

    return peak_activations(compute_order(kind, pp, vpp, m, rank), list(chunk_bytes))[0]


def memory(cfg: Config, lay: Layout) -> int:
    """Bytes the largest rank holds (first or last pipeline stage)."""
    from megaframe.pipeline.schedule import resolve_kind

    m, t = cfg.model, cfg.train
    key = id(cfg)
    # a Config is not hashable for lru_cache: its id keys the cache, and keeping it here stops the id being reused
    _CFGS[key] = cfg
    per_layer, embed, head = _act_per_layer(key, lay.tp, lay.recompute, lay.cp)
    a_bytes = 2 if t.precision == "bf16" else 4
    micro = t.global_batch_size // (lay.micro_batch * lay.dp)
    kind = resolve_kind(cfg.parallel.pp_schedule, lay.vpp)
    chunk_layers = m.num_layers // (lay.pp * lay.vpp)
    worst = 0
    # the first stage holds the embedding, the last the head: the largest rank is one of them
    for rank in {0, lay.pp - 1}:
        first, last = rank == 0, rank == lay.pp - 1
        dense, expert = stage_params(m, lay, first, last)
        n = dense + expert
        # ZeRO reduces grads in an fp32 buffer; without it a grad has its param's dtype
        grads = 4 * n if lay.zero else a_bytes * n
        per_el = 8 if t.precision == "fp32" else 12  # 2 fp32 moments (+ an fp32 master for bf16)
        # expert state is sharded over the expert-data-parallel group (cp·dp / ep ranks), dense over cp·dp
        optim = (per_el * dense // (lay.dp * lay.cp) + per_el * expert // (lay.dp * lay.cp // lay.ep)) if lay.zero else 8 * n
        chunks = tuple(lay.micro_batch * (chunk_layers * per_layer + (embed if c == 0 and first else 0)
                                          + (head if c == lay.vpp - 1 and last else 0)) for c in range(lay.vpp))
        act = _peak_inflight(kind, lay.pp, lay.vpp, micro, rank, chunks) if lay.pp > 1 else chunks[0]
        worst = max(worst, a_bytes * n + grads + optim + act + _cp_bias_bytes(cfg, lay, a_bytes))
    return worst


def _cp_bias_bytes(cfg: Config, lay: Layout, a_bytes: int) -> int:
    """The [S/cp, S] causal bias the layers share under cp_comm=allgather with attention dropout
    (estimate.cp_bias_bytes)."""
    if lay.cp == 1 or cp_ring(cfg) or not cfg.model.dropout > 0:
        return 0
    return cfg.model.seq_length ** 2 // lay.cp * a_bytes


def search(cfg: Config, world: int, dev: Device, memory_bytes: float | None) -> tuple[list[Estimate], int, int]:
    """(fitting estimates, fastest first; candidates; dropped for memory)."""
    # 10 % of a device is kept back for the CUDA context, NCCL buffers and allocator fragmentation
    cap = HEADROOM * (memory_bytes if memory_bytes is not None else dev.memory_gb * 2**30)
    out, dropped = [], 0
    cands = candidates(cfg, world, dev.per_node if not dev.name.startswith("cpu") else world)
    for lay in cands:
        mem = memory(cfg, lay)
        if cap and mem > cap:
            dropped += 1
            continue
        out.append(Estimate(lay, mem, step_time(cfg, lay, dev, world)))
    out.sort(key=lambda e: e.step_s)
    return out, len(cands), dropped


def why_slower(e: Estimate, best: Estimate) -> str:
    """The part that costs this layout the most against the first, in words."""
    diffs = {k: e.parts[k] - best.parts.get(k, 0.0) for k in e.parts}
    k = max(diffs, key=diffs.get)
    what = {"compute": "more compute (recompute)", "tp": "tp communication", "ep": "expert all-to-all",
            "cp": "context-parallel K/V exchange",
            "bubble": "pipeline bubble", "pp": "pipeline p2p", "dp": "data-parallel grad/param traffic"}[k]
    return f"+{100 * (e.step_s / best.step_s - 1):.1f}%: {what} +{diffs[k] * 1e3:.1f} ms"
