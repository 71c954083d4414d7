"""Layout search: every valid (tp, cp, pp, vpp, dp, ep, ZeRO, micro-batch, recompute) of a model on N devices,
sized, timed by a stated model, ranked. cp is searched with the config's parallel.cp_comm.

Memory of the largest rank (first or last pipeline stage): parameters counted from the dims per stage;
grads and optimizer state as the ZeRO optimizer lays them out (estimate.state_bytes' rules without the
bucket padding); activations per micro-batch from meta-device forwards at this tp / sp / recompute
(planning.activations: the bytes of a
block, of the embedding and of the head + loss, on the rank's S/cp tokens), times the micro-batch size,
walked through the rank's own schedule (peak in flight); ZeRO shards over cp·dp.

Step time (seconds) =
    (compute + tp_comm + ep_comm + cp_comm) / (1 - bubble) + pp_comm + dp_comm
  compute  model FLOPs of the step (training.metrics.flops_per_token x tokens; + one forward of the
           blocks for full recompute, + the attention core's forward for selective) / world size
           / (device peak x efficiency)
  comm     per axis: bytes a rank sends (ring all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all
           (n-1)/n of the tensor) / (link bandwidth x link_eff) + ring steps x latency (cpu: ring steps x
           the measured time of one gloo hop of bytes / steps, Device.hops). An axis is on NVLink
           when its ranks fit in one node (tp innermost, then dp (ep within it), then pp), else on IB.
           tp: 4 all-reduce-sized collectives of a micro-batch's activations per block (2 forward, 2
           backward; 6 with full recompute; +1 under sp for the backward's re-gathers), 2 more per
           micro-batch for the embedding and the head, and the vocab-parallel loss's two small
           all-reduces (fp32 per token: the max, then the target logit and the exp-sum); ep: 4
           all-to-alls of the routed tokens per MoE block; pp: one activation and one gradient per
           micro-batch per virtual stage; dp: ZeRO-1 reduce-scatter of fp32 grads + all-gather of params,
           or ZeRO-0's all-reduce, not overlapped with backward (conservative).
  cp       the K/V exchange of every layer and micro-batch (context.cp_bytes_per_layer, the bytes the
           cp byte-count test checks) over tp·cp ranks' links; allgather is on the critical path (K/V are
           needed before attention), the ring overlaps its exchange with the block attention, so only
           what the attention core's compute does not hide is paid (plus the hops' latency). Under cp
           the tp / ep / pp activations are the rank's S/cp tokens; dp reduces over cp·dp.
  bubble   the schedule simulator's idle fraction (pipeline.simulate) for (schedule, pp, vpp, micro-batches).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from megaframe.config import Config, ConfigError, validate
from megaframe.parallel.context import cp_bytes_per_layer
from megaframe.planning.devices import Device
from megaframe.planning.gloo_link import hop_seconds
from megaframe.training.metrics import flops_per_token

RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
HEADROOM = 0.9
"""Fraction of the device memory a layout may fill."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    ep: int
    zero: int
    micro_batch: int
    recompute: str
    cp: int = 1

    def label(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"tp={self.tp}{cp} pp={self.pp} vpp={self.vpp} dp={self.dp}{ep} zero={self.zero} "
                f"mb={self.micro_batch} recompute={self.recompute}")

    def overrides(self) -> list[str]:
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.vpp={self.vpp}",
                f"parallel.ep={self.ep}", f"parallel.cp={self.cp}", f"parallel.sp={str(self.tp > 1).lower()}",
                f"optim.zero={self.zero}",
                f"train.micro_batch_size={self.micro_batch}", f"train.recompute={self.recompute}"]


@dataclass
class Estimate:
    layout: Layout
    memory_bytes: int
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, tp, ep, pp, dp, bubble (the bubble's share of the stretched time)."""

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())


def layout_config(cfg: Config, lay: Layout) -> Config:
    c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=lay.tp, pp=lay.pp, vpp=lay.vpp,
                                                              ep=lay.ep, sp=lay.tp > 1, pp_layout=None, cp=lay.cp),
                            optim=dataclasses.replace(cfg.optim, zero=lay.zero),
                            train=dataclasses.replace(cfg.train, micro_batch_size=lay.micro_batch,
                                                      recompute=lay.recompute))
    return c


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


def _layer_params(m, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one block on one rank."""
    d, e = m.hidden_size, m.head_dim
    attn = (d * (m.num_attention_heads + 2 * m.kv_heads) * e + m.num_attention_heads * e * d) // tp
    norms = 2 * d * (2 if m.norm == "layernorm" else 1)
    if m.num_experts:
        return attn + norms + m.num_experts * d, (m.num_experts // ep) * 3 * d * m.expert_ffn
    per = 3 if m.activation == "swiglu" else 2
    return attn + norms + per * d * m.ffn_hidden_size // tp, 0


def stage_params(m, lay: Layout, first: bool, last: bool) -> tuple[int, int]:
    """(dense, expert) parameters of the first or last pipeline rank."""
    layers = m.num_layers // lay.pp
    dense, expert = (layers * x for x in _layer_params(m, lay.tp, lay.ep))
    table = m.vocab_size * m.hidden_size // lay.tp
    if first:
        dense += table + (m.seq_length * m.hidden_size if m.position_embedding == "learned" else 0)
    if last:
        dense += m.hidden_size + (table if not (first and m.tie_embeddings) else 0)
    return dense, expert


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
def _bubble(kind: str, pp: int, vpp: int, m: int) -> float:
    from megaframe.pipeline.simulate import simulate

    return simulate(kind, pp, vpp, m).bubble


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


def _cp_ring(cfg: Config) -> bool:
    return str(getattr(cfg.parallel.cp_comm, "value", cfg.parallel.cp_comm)) == "ring"


def _cp_bias_bytes(cfg: Config, lay: Layout, a_bytes: int) -> int:
    """The [S/cp, S] causal bias the layers share under cp_comm=allgather with attention dropout
    (estimate.cp_bias_bytes)."""
    if lay.cp == 1 or _cp_ring(cfg) or not cfg.model.dropout > 0:
        return 0
    return cfg.model.seq_length ** 2 // lay.cp * a_bytes


def _ring(nbytes: float, n: int, steps: float, bw: float, latency: float, hops: tuple = ()) -> float:
    """Seconds for a collective moving nbytes per rank over a ring of n ranks in `steps` hops: bandwidth
    plus a latency per hop, or `steps` hops of nbytes / steps on a measured curve (Device.hops)."""
    if n <= 1:
        return 0.0
    return steps * hop_seconds(hops, nbytes / steps) if hops else nbytes / bw + steps * latency


def step_time(cfg: Config, lay: Layout, dev: Device, world: int) -> dict[str, float]:
    """The module docstring's model: seconds per step by part."""
    from megaframe.pipeline.schedule import resolve_kind

    m, t = cfg.model, cfg.train
    a = 2 if t.precision == "bf16" else 4
    tokens = t.global_batch_size * m.seq_length
    micro = t.global_batch_size // (lay.micro_batch * lay.dp)
    fpt = flops_per_token(m)
    attn_core = 12 * m.num_layers * m.seq_length * m.num_attention_heads * m.head_dim
    # recompute adds a forward (a third of fwd + bwd): the attention core's for selective, every block's (all but the head) for
    # full
    extra = {"none": 0.0, "selective": attn_core / 3, "full": (fpt - 6 * m.vocab_size * m.hidden_size) / 3}
    # ranks beyond the cores share them (cpu): each gets cores/world of a core
    share = min(1.0, dev.per_node / world) if dev.name.startswith("cpu") else 1.0
    compute = (fpt + extra[lay.recompute]) * tokens / world / (dev.peak(t.precision) * dev.efficiency * share)

    def link(span: int) -> tuple[float, float]:
        on_node = dev.name.startswith("cpu") or span <= dev.per_node
        return (dev.intra_bw if on_node else dev.inter_bw) * dev.link_eff, dev.latency_s

    layers = m.num_layers // lay.pp
    act = lay.micro_batch * m.seq_length // lay.cp * m.hidden_size * a  # a cp rank's S/cp tokens
    bw, lat = link(lay.tp)
    # + 2 per micro-batch outside the blocks: the embedding's output and the head's input (forward and
    # backward: one all-reduce's worth each way); the vocab-parallel loss adds two small all-reduces
    # under sp the two column-parallel linears re-gather their saved sequence block in backward for the
    # weight grad (layers.linear._GatheredLinear): two more all-gathers, one all-reduce's worth, per block
    per_block = (6 if lay.recompute == "full" else 4) + (1 if lay.tp > 1 else 0)
    colls = per_block * layers * micro + 2 * micro
    tokens_mb = lay.micro_batch * m.seq_length // lay.cp
    tp = (colls * _ring(2 * (lay.tp - 1) / lay.tp * act, lay.tp, 2 * (lay.tp - 1), bw, lat, dev.hops)
          + micro * sum(_ring(2 * (lay.tp - 1) / lay.tp * k * 4 * tokens_mb, lay.tp, 2 * (lay.tp - 1), bw, lat,
                              dev.hops) for k in (1, 2)))  # the logits' max; the target logit and the exp-sum
    ep = 0.0
    if m.num_experts and lay.ep > 1:
        bw, lat = link(lay.tp * lay.ep)
        # each token goes to top_k experts; under sp a tp rank routes its 1/tp of the sequence
        routed = act * m.moe_top_k / (lay.tp if lay.tp > 1 else 1)
        ep = 4 * layers * micro * _ring((lay.ep - 1) / lay.ep * routed, lay.ep, lay.ep - 1, bw, lat, dev.hops)
    # --- context parallelism: the K/V exchange (module doc) ---
    dpcp = lay.dp * lay.cp  # parameters are replicated over cp: grads reduce (and ZeRO shards) over cp·dp
    cp = 0.0
    if lay.cp > 1:
        c, ring = lay.cp, _cp_ring(cfg)
        sent = layers * micro * cp_bytes_per_layer(m.seq_length, c, lay.micro_batch, m.kv_heads // lay.tp,
                                                   m.head_dim, a, ring, lay.recompute)
        reruns = lay.recompute == "full" or (ring and lay.recompute == "selective")
        # ring steps per layer and micro-batch: all-gather K, V and reduce-scatter dK, dV (c-1 each); the
        # ring's c-1 forward moves, c-1 + c backward ones; a re-run forward repeats its own
        hops = layers * micro * ((4 if not ring else 3) * (c - 1) + (1 if ring else 0)
                                 + (2 if not ring else 1) * (c - 1) * reruns)
        bw, lat = link(lay.tp * c)
        cp = _ring(sent, c, hops, bw, lat, dev.hops)
        hop_lat = hops * (hop_seconds(dev.hops, 0) if dev.hops else lat)  # the part no overlap hides
        if ring:  # hidden behind the block attention of the same step, up to the attention core's time
            # the attention core's fwd + bwd (+ the re-run forward): the time the exchange can hide behind
            core = attn_core * (4 / 3 if reruns else 1) * tokens / world
            cp = max(cp - hop_lat - core / (dev.peak(t.precision) * dev.efficiency * share), 0.0) + hop_lat
    # --- end context parallelism ---
    bw, lat = link(lay.tp * lay.cp * lay.dp * lay.pp)
    hop = act / (lay.tp if lay.tp > 1 else 1)
    # an activation forward and a gradient back per micro-batch per virtual stage
    pp = 2 * micro * lay.vpp * _ring(hop, 2, 1, bw, lat, dev.hops) if lay.pp > 1 else 0.0
    dense, expert = stage_params(m, lay, True, lay.pp == 1)
    bw, lat = link(lay.tp * dpcp)
    # one collective per bucket: the ring latency is paid per bucket
    buckets = max(1, math.ceil(4 * (dense + expert) / (cfg.optim.bucket_size_mb * 2**20)))
    if lay.zero:
        edp = dpcp // lay.ep  # ep borrows its ranks from cp·dp
        # reduce-scatter of fp32 grads (4 B) plus all-gather of params (a B) per element
        dp = (_ring((dpcp - 1) / dpcp * (4 + a) * dense, dpcp, 2 * (dpcp - 1) * buckets, bw, lat, dev.hops)
              + _ring((edp - 1) / max(edp, 1) * (4 + a) * expert, edp, 2 * (edp - 1) * buckets, bw, lat, dev.hops))
    else:
        dp = _ring(2 * (dpcp - 1) / dpcp * 4 * (dense + expert), dpcp, 2 * (dpcp - 1) * buckets, bw, lat, dev.hops)
    bubble = _bubble(resolve_kind(cfg.parallel.pp_schedule, lay.vpp), lay.pp, lay.vpp, micro) if lay.pp > 1 else 0.0
    inner = compute + tp + ep + cp
    # the bubble stretches the compute-bound part; reported as its own share so why_slower can name it
    return {"compute": compute, "tp": tp, "ep": ep, "cp": cp, "bubble": inner / (1 - bubble) - inner, "pp": pp, "dp": dp}


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
