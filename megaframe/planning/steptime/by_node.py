"""The experts' all-to-alls under parallel.ep_dispatch=node (model/moe/node_dispatch.py), where the expert
group spans nodes: what steptime.timing's `_ep` charges in place of moe.all_to_all_seconds' single one.

A rank's T tokens (T·K routed rows, `routed` bytes) go first over the rail, one rank a node: a row per
(token, other node it needs), d distinct nodes a token on average (`nodes_per_token`), (N-1)/N of them off
the node, over InfiniBand; with each, its K expert ids (int32, forward only) and K combine weights (fp32,
forward and backward). Then inside each node its share of the K assignments reach their experts over the
node's G ep ranks, NVLink: the T·K routed rows as the plain dispatcher moves them, (G-1)/G of them off the
rank, with one fp32 weight each. The stages run one after the other, each paying its latencies; the way
back mirrors them, and the backward both. Tokens are spread evenly over the rail (balanced routing), the
inner stage carries the busiest rank's rows (moe.imbalance).
"""

from __future__ import annotations

import math

from megaframe.planning.steptime.moe import expert_group, imbalance, spans_nodes


def node_split(s) -> tuple[int, int] | None:
    """(nodes N, ep ranks a node G) of the layout's expert group when its all-to-all goes by node and the
    group spans nodes; None where the plain all-to-all is planned (it is the same one inside a node)."""
    dev, lay, etp = s.dev, s.lay, s.cfg.parallel.etp
    if s.cfg.parallel.ep_dispatch != "node" or not spans_nodes(lay, etp, dev):
        return None
    n, span = expert_group(lay, etp)
    local = max(dev.per_node // max(span // n, 1), 1)
    return n // local, local


def nodes_per_token(m, nodes: int) -> float:
    """Distinct nodes a token's K experts lie on, on average. Under model.moe_force_balance from its rule
    (router.balanced_experts, over the E positions of its period); else K distinct experts drawn alike, as
    Megatron's forced balance draws them and as a balanced trained router spreads them:
    N · (1 - C(E - E/N, K) / C(E, K))."""
    e, k = m.num_experts, m.moe_top_k
    per = e // nodes
    if getattr(m, "moe_force_balance", False):
        step = e // k
        return sum(len({(p + j * step) % e // per for j in range(k)}) for p in range(e)) / e
    return nodes * (1 - math.comb(e - per, k) / math.comb(e, k))


def node_dispatch_seconds(s, routed: float, rows: int, weights: int) -> float:
    """Seconds of one MoE layer's all-to-alls for a micro-batch (module doc): `routed` bytes of the rank's
    routed rows, `rows` crossings of them (dispatch and combine, forward and backward, a re-run's) and
    `weights` of their combine weights, as steptime.timing._ep_colls counts them."""
    dev, m = s.dev, s.cfg.model
    nodes, local = node_split(s)
    k, row = m.moe_top_k, m.hidden_size * s.elem
    pairs = routed / k / row * nodes_per_token(m, nodes) * (nodes - 1) / nodes

    def rail(nbytes: float, times: int) -> float:
        return times * (nbytes / (dev.inter_bw * dev.link_eff) + (nodes - 1) * dev.inter_latency_s)

    def node(nbytes: float, times: int) -> float:
        if local == 1:
            return 0.0
        return times * (nbytes / (dev.intra_bw * dev.link_eff) + (local - 1) * dev.latency_s)

    inner = routed * imbalance(m) * (local - 1) / local
    # the ids go forward only, once a dispatch: one per forward (two where recompute re-runs it)
    t = rail(pairs * row, rows) + rail(pairs * k * 4, rows // 2 - 1) + rail(pairs * k * 4, weights)
    return t + node(inner, rows) + node(inner / row * 4, weights)
