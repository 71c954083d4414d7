"""Layout search: every valid (tp, cp, pp, vpp, dp, ep, ZeRO stage 0-3, HSDP shard group, grad reduce dtype,
micro-batch, recompute) of a model on N devices, sized in every phase, timed by a stated model, ranked. cp is
searched with the config's parallel.cp_comm. ZeRO-0 only for fp32 (bf16 params need ZeRO's fp32 master);
bf16 grad reduction only under bf16; HSDP shard groups of whole nodes (tp·cp·s a multiple of a node) smaller
than cp·dp.

Memory of the largest rank (first or last pipeline stage), the peak over its phases (planning.phases:
start-up, step, save, load; a layout any phase of which is over the memory is dropped): parameters counted
from the dims per stage; grads and optimizer state as the ZeRO optimizer lays them out (estimate.state_bytes'
rules without the bucket padding; ZeRO-2/3 grads and all ZeRO state over the shard group, grads in the
reduce dtype); activations per micro-batch from meta-device forwards at this tp / sp / recompute
(planning.activations: the bytes of a block, of the embedding and of the head + loss, on the rank's S/cp
tokens), times the micro-batch size, walked through the rank's own schedule (peak in flight).

Step time: the stated model of planning.timing (compute, each axis's communication, the bubble).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from megaframe.config import Config, ConfigError, validate
from megaframe.models.counts import matrix_params
from megaframe.optim.rule_registry import rule_named
from megaframe.planning.block_memory import _CFGS, act_per_layer, working_set_bytes
from megaframe.planning.block_memory import on_host as _on_host
from megaframe.planning.candidate import (
    Layout,
    cp_ring,
    end_layers,
    layer_params,
    layout_config,
    stage_layers,
    stage_params,
)
from megaframe.planning.devices import Device
from megaframe.planning.phases import RankShape, head_kind, phase_peaks
from megaframe.planning.timing import step_time

__all__ = [
    "Estimate",
    "Layout",
    "candidates",
    "layout_config",
    "memory",
    "search",
    "stage_params",
    "step_time",
    "why_slower",
]

RECOMPUTE = ("none", "selective", "full", "op_selective")
MICRO_BATCHES = (1, 2, 4, 8)
HEADROOM = 0.9
"""Fraction of the device memory a layout may fill."""


ZERO3_WHOLE_OUTSIDE_BLOCKS = False
"""ZeRO-3 keeps the params outside the blocks (embedding, head, final norm) whole, as optim/sizing.py counts
them today; False once ZeRO-3 shards every parameter."""
MODEL_ERROR = 0.10
"""The search's tie band: sqrt(2) x the step-time model's dispersion on published training runs (the median
of |ratio / median ratio - 1| over planning/published_runs.json, docs/planning.md's table from
scripts/plan_published.py, held by tests/unit/planning/test_plan_published.py): the typical error of the
ratio of two estimates, whose common bias cancels. Layouts closer than this to the fastest are ties."""


@dataclass
class Estimate:
    layout: Layout
    memory_bytes: int
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, tp, ep, pp, dp, bubble (the bubble's share of the stretched time)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak bytes of the largest rank per phase (planning.phases); memory_bytes is their maximum."""

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "memory_bytes": self.memory_bytes,
            "phases": self.phases,
            "step_s": self.step_s,
            "parts_s": self.parts,
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _state_choices(
    cfg: Config, tp: int, cp: int, dp: int, ep: int, per_node: int
) -> list[tuple[int, int, str]]:
    """(zero, HSDP shard group, grad reduce dtype) of one (tp, cp, dp, ep)."""
    bf16 = cfg.train.precision in ("bf16", "fp8")  # fp8 keeps bf16 params with ZeRO's fp32 master
    grads = ("fp32", "bf16") if bf16 else ("fp32",)
    dpcp, out = dp * cp, []
    # HSDP: shard groups of whole nodes
    # (the shard's all-gathers on NVLink or spread evenly over nodes), below cp·dp
    shards = (
        [s for s in divisors(dpcp) if 1 < s < dpcp and (tp * cp * s) % max(per_node, 1) == 0]
        if ep == 1
        else []
    )
    zeros = (1, 2, 3) if dpcp > 1 else (1,)  # nothing to shard over one rank: ZeRO-2/3 build ZeRO-1's layout
    for zero in zeros if bf16 else (0, *zeros):
        for shard in [0] + shards if zero else [0]:
            out += [(zero, shard, g) for g in (grads if zero else ("fp32",))]
    return out


def candidates(cfg: Config, world: int, per_node: int, keep=None, progress=None) -> list[Layout]:
    """Every layout validate() accepts: tp within a node, pp dividing the layers (or, past two stages, the
    first and last stage one block short: Llama 3's 126 layers on pp16), vpp up to 8, sp wherever tp > 1.
    `keep(layout)`: only the layouts it accepts are validated (a narrower search). `progress(text)` hears
    the validation's count every few seconds (minutes for llama3_8b on 64 ranks on a busy machine)."""
    lays = [x for x in _layouts(cfg, world, per_node) if keep is None or keep(x)]
    return _valid(cfg, world, lays, Ticker(progress, "validated", len(lays)))


class Ticker:
    """`progress(f"search: {i}/{total} layouts {what} ...")` at most every EVERY_S seconds: a long search
    says how far it got within seconds instead of looking hung."""

    EVERY_S = 3.0

    def __init__(self, progress, what: str, total: int):
        import time

        self.say, self.what, self.total = progress, what, total
        self.t0 = self.last = time.perf_counter()

    def tick(self, i: int, note: str = "") -> None:
        import time

        now = time.perf_counter()
        if self.say is not None and now - self.last >= self.EVERY_S:
            self.last = now
            self.say(f"search: {i}/{self.total} layouts {self.what}{note} ({now - self.t0:.0f}s)")


def _layouts(cfg: Config, world: int, per_node: int):
    """The layouts candidates() validates, in its order (cheap: no config is built)."""
    m = cfg.model
    # tp within a node: its per-block all-reduces need the intra-node links
    for tp, cp in [(t, c) for t in divisors(world) if t <= max(per_node, 1) for c in divisors(world // t)]:
        for pp, split in _pipelines(m.num_layers, world // (tp * cp)):
            dp = world // (tp * cp * pp)
            micro = {cfg.train.global_batch_size // (b * dp) for b in MICRO_BATCHES} - {0}
            for vpp in [1] if pp == 1 or split else [v for v in VPP if m.num_layers % (pp * v) == 0]:
                # ep borrows its ranks from cp·dp
                for ep, sched in [
                    (e, s)
                    for e in (
                        [e for e in divisors(dp * cp) if m.num_experts % e == 0] if m.num_experts else [1]
                    )
                    for s in _schedules(pp, vpp, micro)
                ]:
                    yield from (
                        Layout(tp, pp, vpp, dp, ep, zero, mb, rc, cp, shard, g, sched, split)
                        for zero, shard, g in _state_choices(cfg, tp, cp, dp, ep, per_node)
                        for mb in MICRO_BATCHES
                        for rc in RECOMPUTE
                    )


VPP = (1, 2, 4, 8)
"""Virtual stages per pipeline rank the search tries."""


def _pipelines(layers: int, ranks: int) -> list[tuple[int, tuple]]:
    """(pp, pp_layout) for each pp dividing `ranks`: an even split where pp divides the layers, and past
    two stages the first and last one block short (they also hold the embedding and the head)."""
    out = []
    for pp in divisors(ranks):
        if layers % pp == 0:
            out.append((pp, ()))
        if pp > 2 and (layers + 2) % pp == 0 and (layers + 2) // pp > 1:
            n = (layers + 2) // pp
            out.append((pp, (n - 1, *[n] * (pp - 2), n - 1)))
    return out


def _schedules(pp: int, vpp: int, micro: set[int]) -> list[str]:
    """The config's schedule (""), and past one stage each spec marked `searched` (zb_h1, zbv) whose chunk
    rule admits (pp, vpp) at one of the micro-batch counts `micro` (validate() checks each layout's)."""
    from megaframe.pipeline.schedule import SCHEDULES

    tried = [s.name for s in SCHEDULES.values() if s.searched and pp > 1]
    return [""] + [k for k in tried if any(SCHEDULES[k].chunk_rule(pp, vpp, m) is None for m in micro)]


def _valid(cfg: Config, world: int, lays: list[Layout], ticker: Ticker | None = None) -> list[Layout]:
    """The layouts validate() accepts. The grad dtype and HSDP group change nothing validate() reads but
    their own checks: one layout per (zero, shard, rest) is validated and its verdict shared."""
    out, seen = [], {}
    for i, lay in enumerate(lays):
        if ticker is not None:
            ticker.tick(i, f", {len(out)} valid")
        key = dataclasses.replace(lay, grad_dtype="fp32")
        if key not in seen:
            try:
                # schedules=False: building every candidate's schedules doubled the search; the layout a
                # user then runs is validated in full (schedules built) by train.py
                validate(layout_config(cfg, key), world, check_data=False, schedules=False)
                seen[key] = True
            except ConfigError:
                seen[key] = False
        if seen[key]:
            out.append(lay)
    return out


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def _peak_inflight(kind: str, pp: int, vpp: int, m: int, rank: int, chunk_bytes: tuple) -> int:
    """Peak activation bytes of the rank's order; a split backward's pending W keeps W_FRACTION of a chunk
    (the weighted ops' inputs and output grads: planning.activations.w_fraction, ~0.49 for llama3_8b's
    blocks)."""
    from megaframe.pipeline.schedule import splits_backward
    from megaframe.pipeline.simulate import W_FRACTION
    from megaframe.planning.estimate import peak_activations

    keep = [int(W_FRACTION * b) for b in chunk_bytes] if splits_backward(kind) else None
    return peak_activations(_order(kind, pp, vpp, m, rank), list(chunk_bytes), keep)[0]


@functools.lru_cache(maxsize=None)
def _order(kind: str, pp: int, vpp: int, m: int, rank: int) -> tuple:
    """A rank's compute order, built once per schedule (every micro-batch size and recompute shares it)."""
    from megaframe.pipeline.schedule import compute_order

    return tuple(compute_order(kind, pp, vpp, m, rank))


def memory(cfg: Config, lay: Layout) -> int:
    """Bytes the largest rank holds at its largest phase (first or last pipeline stage)."""
    return max(phase_memory(cfg, lay).values())


def phase_memory(cfg: Config, lay: Layout) -> dict[str, int]:
    """{phase: peak bytes} of the largest rank
    (the first or the last pipeline stage, whichever peaks higher)."""
    from megaframe.pipeline.schedule import resolve_kind

    m, t = cfg.model, cfg.train
    key = id(cfg)
    # a Config is not hashable for lru_cache: its id keys the
    # cache, and keeping it here stops the id being reused
    _CFGS[key] = cfg
    per_layer, embed, head = act_per_layer(key, lay.tp, lay.recompute, lay.cp)
    a_bytes = 4 if t.precision == "fp32" else 2  # fp8 runs keep bf16 params and activations (layers/fp8.py)
    micro = t.global_batch_size // (lay.micro_batch * lay.dp)
    kind = lay.schedule or resolve_kind(cfg.parallel.pp_schedule, lay.vpp)
    per_rank = stage_layers(m.num_layers, lay)
    worst: dict[str, int] = {}
    # the first stage holds the embedding, the last the head: the largest rank is one of them
    for rank in {0, lay.pp - 1}:
        first, last = rank == 0, rank == lay.pp - 1
        params, grads, optim = _state(cfg, lay, first, last, a_bytes)
        chunk_layers = per_rank[rank] // lay.vpp
        chunks = tuple(
            lay.micro_batch
            * (
                chunk_layers * per_layer
                + (embed if c == 0 and first else 0)
                + (head if c == lay.vpp - 1 and last else 0)
            )
            for c in range(lay.vpp)
        )
        act = _peak_inflight(kind, lay.pp, lay.vpp, micro, rank, chunks) if lay.pp > 1 else chunks[0]
        act += working_set_bytes(cfg, lay.tp, lay.cp, lay.recompute, lay.micro_batch)
        peaks = phase_peaks(
            _shape(cfg, lay, first, last, a_bytes, lay.micro_batch * head),
            params,
            grads,
            optim,
            act + _cp_bias_bytes(cfg, lay, a_bytes),
            on_host=_on_host(cfg),
        )
        if max(peaks.values()) > max(worst.values(), default=-1):
            worst = peaks
    return worst


def _state(cfg: Config, lay: Layout, first: bool, last: bool, a_bytes: int) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of a stage's rank as the optimizer of lay.zero lays them out."""
    m = cfg.model
    dense, expert = stage_params(m, lay, first, last)
    n = dense + expert
    # the rule's bytes per element in optim.state_dtype by kind (Muon: other state on the hidden matrices)
    rule, dt = rule_named(cfg.optim.name), cfg.optim.state_dtype
    hid, other = (rule.bytes_per_element(dt, kind=k) for k in ("hidden", "other"))
    h_dense, h_expert = (end_layers(m, lay, first, last) * x for x in matrix_params(m, lay.tp, lay.ep))
    if not lay.zero:  # a grad per param in its dtype, the rule's state
        return a_bytes * n, a_bytes * n, hid * (h_dense + h_expert) + other * (n - h_dense - h_expert)
    # expert state is sharded over the expert-data-parallel group (cp·dp / ep ranks), dense over the shard one
    s, es = lay.shard_size, max(lay.shard_size // lay.ep, 1)
    owned, hidden = dense // s + expert // es, h_dense // s + h_expert // es
    state = hid * hidden + other * (owned - hidden)
    g = 2 if lay.grad_dtype == "bf16" else 4
    grads = g * (owned if lay.zero >= 2 else n)
    if lay.zero == 3:  # params: the fp32 owned range (the master), plus what stays whole; state: the rule's
        outside = n - end_layers(m, lay, first, last) * sum(layer_params(m, lay.tp, lay.ep))
        whole = a_bytes * outside if ZERO3_WHOLE_OUTSIDE_BLOCKS else 0
        return 4 * owned + whole, grads, state
    # a master: 4 more bytes per owned element of low-precision params
    return a_bytes * n, grads, state + (0 if cfg.train.precision == "fp32" else 4) * owned


def _shape(cfg: Config, lay: Layout, first: bool, last: bool, a_bytes: int, head_act: int = 0) -> RankShape:
    """planning.phases' view of a stage's rank, from the dims (estimate.rank_shape counts a built model)."""
    m = cfg.model
    dense, expert = stage_params(m, lay, first, last)
    d, per = m.hidden_size, (2 if m.activation == "swiglu" else 1)
    mats = [d * (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim // lay.tp]
    mats.append(
        (m.num_experts // lay.ep) * per * m.expert_ffn * d
        if m.num_experts
        else per * m.ffn_hidden_size * d // lay.tp
    )
    block_mat = max(mats)
    table = m.vocab_size * d // lay.tp
    if first or last:
        mats.append(table)
    block_numel = sum(layer_params(m, lay.tp, lay.ep))
    logits = lay.micro_batch * m.seq_length // lay.cp * m.vocab_size // lay.tp if last else 0
    s = lay.shard_size or 1
    tied_across = m.tie_embeddings and lay.pp > 1
    # the largest owned segment a resume reads into
    # (estimate._read_bytes): ZeRO-3's units are buckets of their own
    if lay.zero == 3:
        read = 4 * min(max(mats), max(block_numel, table) // s)
    elif lay.zero:
        read = max(a_bytes * max(mats), 4 * min(max(mats), int(cfg.optim.bucket_size_mb * 2**20) // 4 // s))
    else:
        read = 4 * max(mats)
    return RankShape(
        dense + expert,
        max(mats),
        a_bytes * block_numel,
        a_bytes,
        s,
        lay.dp * lay.cp,
        lay.zero,
        logits,
        a_bytes * block_numel * end_layers(m, lay, first, last),
        grad_elem=2 if lay.grad_dtype == "bf16" else 4,
        out_numel=(d + table) if last else 0,
        out_acc=not tied_across,
        block_param_numel=block_mat,
        head_act=head_act if last else 0,
        read_bytes=read,
        gloo=_on_host(cfg),
        head_kind=head_kind(lay.tp, cfg.train.fused_head_loss),
        reshard=cfg.optim.reshard_after_forward,
    )


def _cp_bias_bytes(cfg: Config, lay: Layout, a_bytes: int) -> int:
    """The [S/cp, S] causal bias the layers share under cp_comm=allgather with attention dropout
    (estimate.cp_bias_bytes)."""
    if lay.cp == 1 or cp_ring(cfg) or not cfg.model.dropout > 0:
        return 0
    return cfg.model.seq_length**2 // lay.cp * a_bytes


def search(
    cfg: Config, world: int, dev: Device, memory_bytes: float | None, progress=None, keep=None
) -> tuple[list[Estimate], int, int]:
    """(fitting estimates, the tie group first (break_ties), then by time; candidates; dropped for memory).
    `progress(text)` hears how far it got every few seconds (the command prints it to stderr); `keep`
    narrows the candidates (candidates())."""
    import time

    # 10 % of a device is kept back for the CUDA context, NCCL buffers and allocator fragmentation
    cap = HEADROOM * (memory_bytes if memory_bytes is not None else dev.memory_gb * 2**30)
    out, dropped, t0 = [], 0, time.perf_counter()
    say = progress or (lambda text: None)
    say("search: enumerating and validating layouts")
    cands = candidates(cfg, world, dev.per_node if not dev.name.startswith("cpu") else world, keep, say)
    # the first layouts of a shape build its meta-device activation tables (seconds each): say so first
    say(f"search: {len(cands)} valid layouts; sizing and timing them")
    ticker = Ticker(say, "sized and timed", len(cands))
    for i, lay in enumerate(cands, 1):
        ticker.tick(i, f", {len(out)} fit")
        phases = phase_memory(cfg, lay)
        mem = max(phases.values())
        if cap and mem > cap:
            dropped += 1
            continue
        out.append(Estimate(lay, mem, step_time(cfg, lay, dev, world), phases))
    out.sort(key=lambda e: (e.step_s, e.memory_bytes))
    say(f"search: {len(cands)} layouts in {time.perf_counter() - t0:.0f}s")
    return break_ties(out), len(cands), dropped


def axes_used(lay: Layout) -> int:
    """Parallel axes a layout uses beyond plain data parallelism, and its optional features: fewer is
    simpler to run and to debug."""
    return (
        sum(x > 1 for x in (lay.tp, lay.cp, lay.pp, lay.vpp, lay.ep))
        + (lay.zero >= 2)
        + bool(lay.shard)
        + (lay.grad_dtype != "fp32")
        + bool(lay.schedule)
        + (lay.recompute != "none")
    )


def break_ties(ests: list[Estimate], error: float = MODEL_ERROR) -> list[Estimate]:
    """The layouts within the model's error of the fastest ordered by memory headroom (least peak memory
    first, in whole GiB: a few MiB is no headroom anyone can use), then simplicity (axes_used), then time;
    the rest stay by time."""
    k = ties(ests, error)
    head = sorted(ests[:k], key=lambda e: (round(e.memory_bytes / 2**30), axes_used(e.layout), e.step_s))
    return head + ests[k:]


def ties(ests: list[Estimate], error: float = MODEL_ERROR) -> int:
    """How many layouts are within the model's error of the fastest (the tie group, first in the ranking)."""
    if not ests:
        return 0
    best = min(e.step_s for e in ests)
    return sum(1 for e in ests if e.step_s <= best * (1 + error))


def why_slower(e: Estimate, best: Estimate) -> str:
    """The part that costs this layout the most against the first, in words."""
    diffs = {k: e.parts[k] - best.parts.get(k, 0.0) for k in e.parts}
    k = max(diffs, key=diffs.get)
    what = {
        "compute": "more compute (recompute)",
        "tp": "tp communication",
        "ep": "expert all-to-all",
        "cp": "context-parallel K/V exchange",
        "bubble": "pipeline bubble",
        "pp": "pipeline p2p",
        "dp": "data-parallel grad/param traffic",
    }[k]
    return f"+{100 * (e.step_s / best.step_s - 1):.1f}%: {what} +{diffs[k] * 1e3:.1f} ms"
