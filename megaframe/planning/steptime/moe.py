"""The step-time model's MoE parts (steptime.compute, steptime.timing): what a rank spends on its experts.

Placement as the trainer runs it (parallel/rank_grid.py): the experts fold each stage's tp·cp·dp ranks
as etp x ep x edp, etp innermost, so an ep group's members lie etp apart and it spans ep·etp consecutive
ranks (`expert_group`, read from the mesh's own rank arithmetic), each group holding every expert (E/ep a
rank, each split over etp). Each rank routes its own tokens (T = micro-batch x S/cp, 1/tp of them under sp).

  grouped GEMMs  a rank's experts receive T·top_k rows on average (dropless), IMBALANCE x that on the
                 busiest rank; each of its E/ep experts runs [rows / (E/ep), D] x [D, ffn] as one group of
                 moe/grouped.py's grouped GEMM: timed per expert on the size curve (fine-grained experts,
                 e.g. 128 x 768, run far below the peak a single [T·top_k, D] GEMM would reach).
  router         the router's [T, D] x [D, E] GEMM, its fp32 softmax / top-k over [T, E], and the
                 permutation: the routed rows written into expert order and back (dispatch and combine)
                 and their gradients, over HBM.
  all-to-all     4 per MoE layer and micro-batch (dispatch and combine, forward and backward; a re-run
                 forward repeats its 2) of the busiest rank's routed rows, (ep-1)/ep of them leaving it:
                 on NVLink when the group is inside a node, else the share bound for other nodes over
                 InfiniBand (ep/node of the peers are local), plus ep-1 steps of that link's latency.
  shared experts a dense MLP beside the routed ones (model.moe_shared_experts x the expert width, where
                 a family has them): a plain GEMM on every token.

IMBALANCE is an assumption, stated: the busiest expert rank's load over the mean under an auxiliary
load-balancing loss (Switch Transformer, Fedus et al. 2021, and GShard report per-expert loads within
~1.1-1.3 x of the mean once balanced; DeepSeek-V3's report the same order): 1.2.
"""

from __future__ import annotations

IMBALANCE = 1.2
"""Busiest rank's routed rows over the mean (module doc: an assumption with its sources)."""


def expert_group(lay, etp: int) -> tuple[int, int]:
    """(ranks in the expert group, consecutive global ranks it spans) as the mesh folds it."""
    from megaframe.parallel.rank_grid import folded_expert_groups

    return lay.ep, folded_expert_groups(lay.tp, lay.cp, lay.dp, lay.ep, etp, lay.shard_size).ep_span


def expert_gemms(m, tp: int) -> tuple[tuple[int, int], ...]:
    """(k, n) of one expert's up (gate fused under swiglu) and down projections on a tp rank."""
    d, f = m.hidden_size, m.expert_ffn
    up = (2 if "swiglu" in str(getattr(m.activation, "value", m.activation)) else 1) * f
    return ((d, up // tp), (f // tp, d))


def expert_rows(m, tokens: int, ep: int) -> float:
    """Rows one local expert of the busiest rank multiplies in a micro-batch (module doc)."""
    return IMBALANCE * tokens * m.moe_top_k * ep / m.num_experts


def experts_seconds(gemm_seconds, dev, prec: str, m, tokens: int, tp: int, ep: int) -> float:
    """Forward seconds of the rank's experts: E/ep grouped GEMM groups on the size curve, plus a shared
    expert's dense GEMMs where the model has one."""
    rows = max(1, round(expert_rows(m, tokens, ep)))
    local = m.num_experts // ep
    t = local * sum(gemm_seconds(dev, prec, rows, k, n) for k, n in expert_gemms(m, tp))
    # DeepSeek's shared experts: one dense SwiGLU of moe_shared_experts x the expert width on every token
    shared = (getattr(m, "moe_shared_experts", 0) or 0) * m.expert_ffn
    if shared:
        t += gemm_seconds(dev, prec, tokens, m.hidden_size, 2 * shared // tp)
        t += gemm_seconds(dev, prec, tokens, shared // tp, m.hidden_size)
    return t


def router_bytes(m, tokens: int, elem: int) -> float:
    """HBM bytes of the router's softmax / top-k and the permutation, forward + backward (module doc)."""
    scores = tokens * m.num_experts * 4 * 4  # fp32 logits -> probabilities -> top-k, and their grads
    permute = 2 * 2 * tokens * m.moe_top_k * m.hidden_size * elem  # dispatch + combine, read + write
    return 2 * (scores + permute)


def all_to_all_seconds(s, routed_bytes: float) -> float:
    """Seconds of one all-to-all of a rank's routed rows over its expert group (module doc); s: the
    timing's _Step (its device, layout and link model)."""
    dev, lay = s.dev, s.lay
    n, span = expert_group(lay, s.cfg.parallel.etp)
    if n <= 1:
        return 0.0
    out = (n - 1) / n * routed_bytes * IMBALANCE
    if dev.name.startswith("cpu") or span <= dev.per_node:
        return s.coll(out, n, n - 1, span)
    # group peers on this node: members lie span / n apart
    local = max(dev.per_node // max(span // n, 1), 1)
    off = (n - local) / (n - 1) * out
    on = out - off
    intra = on / (dev.intra_bw * dev.link_eff) + (local - 1) * dev.latency_s
    inter = off / (dev.inter_bw * dev.link_eff) + (n - local) * dev.inter_latency_s
    return max(intra, inter)
