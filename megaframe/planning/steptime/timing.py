"""The planner's step-time model: seconds per step of a layout, by part (planning.search ranks by it).

Step time (seconds) =
    (compute + tp_comm + ep_comm + cp_comm + launch) / (1 - bubble) + pp_comm + dp_comm + optim
  compute  the slowest pipeline rank's compute seconds by kind of work (planning.steptime.compute: its blocks'
           GEMMs on a roofline with a size curve, fp8 at its own peak, the causal attention core, the
           elementwise work over HBM, the head and fused cross-entropy on the last rank, recompute's re-run)
  comm     per axis: bytes a rank sends (ring all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all
           (n-1)/n of the tensor) / (link bandwidth x link_eff) + ring steps x that link's latency (cpu: ring
           steps x the measured time of one gloo hop of bytes / steps, Device.hops). An axis is on NVLink
           when its ranks fit in one node (tp innermost, then cp, dp (ep within cp·dp), then pp), else on IB.
           tp: 4 all-reduce-sized collectives of a micro-batch's activations per block (2 forward, 2
           backward; 6 with full recompute; +1 under sp for the backward's re-gathers), 2 more per
           micro-batch for the embedding and the head, and the vocab-parallel loss's two small
           all-reduces (fp32 per token: the max, then the target logit and the exp-sum); ep: the
           experts' all-to-alls over the expert group (planning.steptime.moe); pp: one activation and one
           gradient per micro-batch per virtual stage; dp: see below.
  dp       the reduce-scatter of grads in the reduce dtype (fp32 or bf16: optim.grad_reduce_dtype) over the
           shard group and the all-gather of params, ZeRO-0's all-reduce, HSDP's all-reduce of the shard over
           the replicas; charged as the trainer overlaps them (_dp_exposed): ZeRO-1 reduces during the last
           micro-batch's backward, ZeRO-2 during every backward, ZeRO-3 gathers block by block ahead of
           forward and backward; the param all-gather runs during the next forward. What the overlapped
           compute cannot hide is paid, plus one bucket (the last reduce, the first gather) that nothing
           hides; ZeRO-3's unit hides only behind its own unit's compute (a unit's excess is paid, not
           absorbed elsewhere), and a link that carries tp / cp traffic during the compute lends dp only the
           rest of it. ZeRO-0's all-reduce and HSDP's replica all-reduce run after backward: paid in full.
  tp overlap  under parallel.tp_comm_overlap (not fp8) the blocks' tp collectives are paid only where the
           blocks' GEMMs cannot cover them, plus one chunk (parallel.tp_comm_chunks) nothing hides.
  cp       the K/V exchange of every layer and micro-batch (context.cp_bytes_per_layer, the bytes the
           cp byte-count test checks) over tp·cp ranks' links; allgather is on the critical path (K/V are
           needed before attention), the ring overlaps its exchange with the block attention, so only
           what the attention core's compute does not hide is paid (plus the hops' latency). Under cp
           the tp / ep / pp activations are the rank's S/cp tokens; dp reduces over cp·dp.
  optim    the optimizer's update of the owned elements over HBM (planning.steptime.fixed)
  launch   the host's kernel launches where a block's GPU work per micro-batch is shorter than their issue
           time, and the MoE dispatcher's host sync per layer forward with the counts' collectives ahead
           of it (planning.steptime.launches); each collective call's latency is in its axis's ring
           steps above.
  overlap  the overlapped kinds (1f1b_overlap, interleaved_overlap: pipeline/overlap.py) run each steady
           forward beside another micro-batch's backward: in that share of the micro-batches' work the
           experts' all-to-alls are paid only where they outlast the compute beside them (_overlapped_ep)
  bubble   the schedule simulator's idle fraction (pipeline.simulate) for (schedule, pp, vpp, micro-batches);
           the kinds whose spec splits the backward (zb_h1, zbv) are timed with F, B, W costs from the
           backward's split
           (split_costs: B the activation-grad GEMMs + attention backward, W the weight-grad GEMMs).

Checked against measured runs on this machine by benchmarks/validate_planner.py (docs/planning.md: the
six-layout table).
"""

from __future__ import annotations

import functools
import math

from megaframe.config.schema import Config
from megaframe.parallel.context import cp_bytes_per_layer
from megaframe.parallel.rank_grid import ExpertGroups, folded_expert_groups
from megaframe.planning.candidate import Layout, cp_ring, stage_params
from megaframe.planning.devices import Device
from megaframe.planning.gloo_link import hop_seconds
from megaframe.planning.steptime.by_node import (
    NODE_KERNELS,
    node_colls,
    node_counts_seconds,
    node_dispatch_seconds,
    node_split,
)
from megaframe.planning.steptime.compute import rerun_gemm_share
from megaframe.planning.steptime.inputs import Step
from megaframe.planning.steptime.moe import all_to_all_seconds
from megaframe.training.metrics import flops_per_token


@functools.lru_cache(maxsize=None)
def _bubble(kind: str, pp: int, vpp: int, m: int, costs: tuple | None = None) -> float:
    """Idle / makespan of the schedule's simulated step; costs (F, B, W) matter only to the zero-bubble
    kinds (the others' idle fraction does not depend on them, so they are not keyed on them)."""
    from megaframe.pipeline.simulate import Costs, simulate

    return simulate(kind, pp, vpp, m, costs=Costs(*costs) if costs else None).bubble


def split_costs(cfg: Config, recompute: str = "none") -> tuple[float, float, float]:
    """(F, B, W) FLOPs per token of a micro-batch through the model, from the backward's split: F is the
    GEMMs' forward (2 per weight) and the attention core's; B the activation-grad GEMMs (2 per weight) and
    the attention core's backward (twice its forward), plus what recompute re-runs; W the weight-grad
    GEMMs (2 per weight). Rounded to 3 digits: the bubble is simulated once per distinct ratio."""
    m = cfg.model
    attn = 4 * m.num_layers * m.seq_length * m.num_attention_heads * m.head_dim  # forward: QK^T and PV
    gemm = (flops_per_token(m) - 3 * attn) / 6  # the weighted matmuls' forward, per 2 FLOPs
    f, b, w = 2 * gemm + attn, 2 * gemm + 2 * attn, 2 * gemm
    blocks = 2 * (gemm - m.vocab_size * m.hidden_size)  # the blocks' weighted matmuls' forward
    b += {
        "none": 0.0,
        "selective": attn,
        "full": blocks + attn,
        "op_selective": rerun_gemm_share(m) * blocks,
    }[recompute]
    return tuple(float(f"{x / f:.3g}") for x in (1.0 * f, b, w))


def _compute(s: Step) -> float:
    return sum(s.work.values()) / s.share


def _tp(s: Step) -> float:
    lay, tp = s.lay, s.lay.tp
    # under sp the two column-parallel linears re-gather their saved sequence block in backward for the
    # weight grad (layers.linear._GatheredLinear): two more all-gathers, one all-reduce's worth, per block;
    # + 2 per micro-batch outside the blocks: the embedding's output and the head's input
    # full and op_selective re-run the block's forward collectives in backward (model/recompute.py)
    per_block = (6 if lay.recompute in ("full", "op_selective") else 4) + (1 if tp > 1 else 0)
    colls = per_block * s.layers * s.micro + 2 * s.micro
    tokens_mb = lay.micro_batch * s.cfg.model.seq_length // lay.cp
    one = s.coll(2 * (tp - 1) / tp * s.act, tp, 2 * (tp - 1), tp)
    blocks = colls * one
    p = s.cfg.parallel
    if p.tp_comm_overlap and tp > 1 and s.cfg.train.precision != "fp8":
        # collective matmul (layers/tp_overlap.py): each block's gathers and reduce-scatters run chunk by
        # chunk under its partial GEMMs; paid: what the GEMMs cannot cover, plus the first chunk's
        in_blocks = per_block * s.layers * s.micro * one
        gemm = s.work["gemm"] / s.share
        blocks += max(in_blocks - gemm, 0.0) + in_blocks / max(p.tp_comm_chunks, 1) - in_blocks
    # the vocab-parallel loss: the logits' max, then the target logit and the exp-sum (fp32 per token)
    loss = s.micro * sum(s.coll(2 * (tp - 1) / tp * k * 4 * tokens_mb, tp, 2 * (tp - 1), tp) for k in (1, 2))
    return blocks + loss


def _ep(s: Step) -> float:
    """The experts' all-to-alls over the expert group (planning.steptime.moe): the rows' dispatch and
    combine, forward and backward, the fp32 combine weights' dispatch (they travel with their rows to be
    applied inside the experts: moe/dispatcher.py), forward and backward, and the forward's again where
    recompute re-runs it. Each pays its own latency."""
    m, lay = s.cfg.model, s.lay
    if not m.num_experts or lay.ep == 1:
        return 0.0
    # each token goes to top_k experts; under sp a tp rank routes its 1/tp of the sequence
    routed = s.act * m.moe_top_k / (lay.tp if lay.sp else 1)
    rows, weights = _ep_colls(lay)
    # one fp32 weight (4 bytes) a routed row of D elements
    weight_bytes = routed / (m.hidden_size * s.elem) * 4
    if node_split(s) is not None:  # parallel.ep_dispatch=node across nodes: two stages (steptime.by_node)
        return s.layers * s.micro * node_dispatch_seconds(s, routed, rows, weights)
    one = rows * all_to_all_seconds(s, routed) + weights * all_to_all_seconds(s, weight_bytes)
    return s.layers * s.micro * one


def _ep_colls(lay: Layout) -> tuple[int, int]:
    """(all-to-alls of the routed rows, of their combine weights) an MoE layer issues per micro-batch
    under ep: rows 2 forward (dispatch, combine) and their 2 backward, the weights 1 forward (dispatch)
    and its backward; a re-run forward repeats its 2 and 1."""
    rerun = lay.recompute in ("full", "op_selective")
    return 4 + (2 if rerun else 0), 2 + (1 if rerun else 0)


def _experts(s: Step) -> ExpertGroups:
    """The layout's folded expert groups (sizes and spans), read from the mesh's own rank arithmetic."""
    lay = s.lay
    return folded_expert_groups(lay.tp, lay.cp, lay.dp, lay.ep, s.cfg.parallel.etp, lay.shard_size)


def _cp(s: Step) -> float:
    """The K/V exchange (module doc); the ring's is hidden behind the block attention up to its time."""
    m, lay, c = s.cfg.model, s.lay, s.lay.cp
    if c == 1:
        return 0.0
    ring = cp_ring(s.cfg)
    sent = (
        s.layers
        * s.micro
        * cp_bytes_per_layer(
            m.seq_length, c, lay.micro_batch, m.kv_heads // lay.tp, m.head_dim, s.elem, ring, lay.recompute
        )
    )
    reruns = lay.recompute in ("full", "op_selective") or (ring and lay.recompute == "selective")
    # ring steps per layer and micro-batch: all-gather K, V and reduce-scatter dK, dV (c-1 each); the
    # ring's c-1 forward moves, c-1 + c backward ones; a re-run forward repeats its own
    hops = (
        s.layers
        * s.micro
        * ((4 if not ring else 3) * (c - 1) + (1 if ring else 0) + (2 if not ring else 1) * (c - 1) * reruns)
    )
    t = s.coll(sent, c, hops, lay.tp * c)
    if not ring:
        return t
    hop_lat = hops * (hop_seconds(s.dev.hops, 0) if s.dev.hops else s.dev.latency_s)  # no overlap hides it
    core = s.work["attention"] / s.share  # the attention core's fwd + bwd (+ a re-run forward)
    return max(t - hop_lat - core, 0.0) + hop_lat


def _tp_colls_per_block(lay: Layout) -> int:
    """The tp collectives one block issues per micro-batch (_tp's count)."""
    if lay.tp == 1:
        return 0
    return (6 if lay.recompute in ("full", "op_selective") else 4) + 1


def block_host_seconds(s: Step, gpu_s: float) -> float:
    """What the host adds to one block's micro-batch of gpu_s GPU seconds (planning.steptime.launches): the
    launches it exposes and, in an MoE block, the dispatcher's host sync with the counts' collectives ahead
    of it, once a forward (twice where recompute re-runs it). 0 on the cpu (no launch queue)."""
    from megaframe.planning.steptime import launches as launch

    if not s.dev.hbm_bw:
        return 0.0
    m, lay = s.cfg.model, s.lay
    rerun = lay.recompute in ("full", "op_selective")
    by_node = m.num_experts and node_split(s) is not None
    ep_colls = sum(_ep_colls(lay)) if m.num_experts and lay.ep > 1 else 0
    if by_node:  # two stages, each with the plain exchange's rows and weights, and the ids
        ep_colls = node_colls(*_ep_colls(lay))
    gathered = lay.cp > 1 and not cp_ring(s.cfg)
    colls = _tp_colls_per_block(lay) + ep_colls
    k = launch.block_kernels(m, bool(s.cfg.train.compile), colls, rerun, lay.ep, gathered)
    if by_node:
        k += NODE_KERNELS[0] * (2 if rerun else 1) + NODE_KERNELS[1]
    t = launch.exposed(k, gpu_s)
    if m.num_experts:
        # dispatch by node syncs twice a forward: each of its two all-to-alls needs its split sizes
        syncs = 2 if by_node else 1
        t += (2 if rerun else 1) * (launch.moe_sync_seconds(syncs) + _moe_count_colls(s))
    return t


def _launch(s: Step) -> float:
    """Launch-bound time and MoE host syncs of the step (block_host_seconds per block and micro-batch, the
    head's launches per micro-batch); 0 on the cpu (no launch queue)."""
    from megaframe.planning.steptime import launches as launch

    if not s.dev.hbm_bw:
        return 0.0
    per_mb = s.layers * s.micro
    work = s.work
    blocks = (sum(work.values()) - work["head"]) / s.share / max(per_mb, 1)
    t = per_mb * block_host_seconds(s, blocks)
    if work["head"]:
        head = launch.head_kernels(bool(s.cfg.train.compile))
        t += s.micro * launch.exposed(head, work["head"] / s.share / s.micro)
    return t


def _moe_count_colls(s: Step) -> float:
    """The small collectives of int64 expert counts an MoE layer's forward issues ahead of its host sync,
    so nothing hides their latency: under sp and cp the routed counts of each run gathered over the ranks
    splitting the sequence (model/moe/layer.py's _batch_counts: up to 2 runs a rank under cp), the counts'
    all-to-all over the expert group and, under etp, their all-gather over it (moe/dispatcher.py). The
    combine weights' all-to-all runs after the sync, beside the rows' (_ep)."""
    lay, e = s.lay, s.cfg.model.num_experts
    t = all_to_all_seconds(s, 8 * e) if lay.ep > 1 else 0.0
    if node_split(s) is not None:  # the rail's pair counts, then the node's expert counts
        t = node_counts_seconds(s)
    runs = 2 if lay.cp > 1 else 1
    if lay.tp > 1 and lay.sp:
        t += s.coll((lay.tp - 1) * runs * e * 8, lay.tp, lay.tp - 1, lay.tp)
    if lay.cp > 1:
        t += s.coll((lay.cp - 1) * runs * e * 8 * lay.tp, lay.cp, lay.cp - 1, lay.tp * lay.cp)
    etp = s.cfg.parallel.etp
    if lay.ep > 1 and etp > 1:
        t += s.coll((etp - 1) * e * 8, etp, etp - 1, etp)
    return t


def _pp(s: Step) -> float:
    lay = s.lay
    if lay.pp == 1:
        return 0.0
    # an activation forward and a gradient back per micro-batch per virtual stage (sp: 1/tp of it)
    return 2 * s.micro * lay.vpp * s.coll(s.act / lay.tp, 2, 1, lay.tp * lay.cp * lay.dp * lay.pp)


def _dp(s: Step) -> float:
    """The dp time the step pays (module doc): each collective's time less the compute it overlaps."""
    lay, cfg = s.lay, s.cfg
    dense, expert = stage_params(cfg.model, lay, True, lay.pp == 1)
    n = dense + expert
    dpcp = lay.dp * lay.cp  # parameters are replicated over cp: grads reduce (and ZeRO shards) over cp·dp
    # one collective per bucket: the ring latency is paid per bucket. The experts' grads are a buffer of
    # their own with its own buckets (optim/buffer.py's bucket_plan per buffer), reduced over their group;
    # ZeRO-3's buckets are its blocks (and the params outside them), whatever bucket_size_mb says
    # (optim/sizing.py's group_plan)
    bucket = cfg.optim.bucket_size_mb * 2**20
    dense_b, expert_b = (max(1, math.ceil(4 * x / bucket)) for x in (dense, expert))
    if lay.zero == 3:
        dense_b = expert_b = s.layers + 1
    edp = _experts(s).edp_shard  # experts shard over tp·cp·dp / (ep·etp), cut by HSDP's replicas
    buckets = dense_b + (expert_b if expert and edp > 1 else 0)
    if not lay.zero:  # an all-reduce of the fp32 grads after backward: nothing hides it
        return s.coll(2 * (dpcp - 1) / dpcp * 4 * n, dpcp, 2 * (dpcp - 1) * buckets, lay.tp * dpcp)
    g, a, sh = (2 if lay.grad_dtype == "bf16" else 4), s.elem, lay.shard_size
    span = lay.tp * sh

    def ring(bytes_per_el: float, times: int) -> float:
        """`times` reduce-scatters (or all-gathers) of every element at bytes_per_el over the shard group."""
        # a dense model has no expert collective: no latency either (it was charged one before)
        moe = 0.0
        if expert:
            moe = s.coll((edp - 1) / edp * bytes_per_el * expert, edp, (edp - 1) * expert_b, span)
        return times * (s.coll((sh - 1) / sh * bytes_per_el * dense, sh, (sh - 1) * dense_b, span) + moe)

    compute = _compute(s)
    # a link carrying the tp / cp exchanges during the compute lends dp only the rest of its time
    d = s.dev
    intra = d.name.startswith("cpu") or span <= d.per_node
    busy = (_tp(s) if intra else 0.0) + (_cp(s) if (lay.tp * lay.cp <= d.per_node) == intra else 0.0)
    compute_free = compute * max(1.0 - busy / max(compute, 1e-12), 0.1)
    fwd, bwd, micro = compute_free / 3, 2 * compute_free / 3, s.micro
    if lay.zero == 3:
        # block by block: the next unit's gather hides behind one unit's forward (and backward, where
        # reshard_after_forward gathers again), the reduce-scatter behind one unit's backward; a unit's
        # traffic the unit's own compute cannot cover is paid, not absorbed by the rest of the step. A unit
        # is a block (and the params outside them), its dense and expert collectives alike
        units = (s.layers + 1) * micro
        f_gather, b_coll = ring(a, micro) / units, ring(g, micro) / units
        if cfg.optim.reshard_after_forward:
            b_coll += f_gather
        per = max(f_gather - fwd / units, 0.0) + max(b_coll - bwd / units, 0.0)
        return units * per + (f_gather + b_coll) + _hsdp(s, n, g, sh, buckets)
    if lay.zero == 2:  # a reduce-scatter per micro-batch in its backward; the gather in the next forward
        hidden = [(ring(g, micro), bwd), (ring(a, 1), fwd / micro)]
    else:  # one reduce-scatter in the last micro-batch's backward; the gather in the next forward
        hidden = [(ring(g, 1), bwd / micro), (ring(a, 1), fwd / micro)]
    tail = sum(t for t, _ in hidden) / max(
        buckets * micro, 1
    )  # the last reduce / first gather: nothing hides it
    return sum(max(t - window, 0.0) for t, window in hidden) + tail + _hsdp(s, n, g, sh, buckets)


def _hsdp(s: Step, n: int, g: int, sh: int, buckets: int) -> float:
    """HSDP: the owned shard all-reduced over the replicas after backward (paid in full)."""
    lay = s.lay
    dpcp = lay.dp * lay.cp
    rep = dpcp // sh
    if rep <= 1:
        return 0.0
    return s.coll(2 * (rep - 1) / rep * g * n / sh, rep, 2 * (rep - 1) * buckets, lay.tp * dpcp)


def _overlapped_ep(kind: str, lay: Layout, micro: int, ep: float, compute: float) -> float:
    """The experts' all-to-all time left exposed: all of it, but under an overlapped kind, whose pairs (a
    forward beside another micro-batch's backward) run a share of the micro-batches' work where each
    side's exchanges overlap the other's compute; there only what outlasts that compute is paid. The
    share is the first pipeline rank's (the longest warm-up: the fewest pairs)."""
    from megaframe.pipeline.schedule import SCHEDULES

    spec = SCHEDULES.get(kind)
    if spec is None or not spec.overlap or ep <= 0.0:
        return ep
    total = micro * lay.vpp
    share = max(total - spec.warmup(lay.pp, lay.vpp, micro, 0), 0) / total
    return (1.0 - share) * ep + share * max(ep - compute, 0.0)


def step_time(cfg: Config, lay: Layout, dev: Device, world: int) -> dict[str, float]:
    """The module docstring's model: seconds per step by part."""
    from megaframe.pipeline.schedule import resolve_kind, splits_backward

    s = Step(cfg, lay, dev, world)
    compute, tp, ep, cp, fixed = _compute(s), _tp(s), _ep(s), _cp(s), _launch(s)
    from megaframe.planning.steptime.fixed import optimizer_seconds

    kind = lay.schedule or resolve_kind(cfg.parallel.pp_schedule, lay.vpp)
    ep = _overlapped_ep(kind, lay, s.micro, ep, compute)
    costs = split_costs(cfg, lay.recompute) if splits_backward(kind) else None
    bubble = _bubble(kind, lay.pp, lay.vpp, s.micro, costs) if lay.pp > 1 else 0.0
    # launch-bound time stretches with the micro-batches' work, so the bubble scales it too
    inner = compute + tp + ep + cp + fixed
    # the bubble stretches the compute-bound part; reported as its own share so why_slower can name it
    return {
        "compute": compute,
        "tp": tp,
        "ep": ep,
        "cp": cp,
        "launch": fixed,
        "bubble": inner / (1 - bubble) - inner,
        "pp": _pp(s),
        "dp": _dp(s),
        "optim": optimizer_seconds(s),
    }
