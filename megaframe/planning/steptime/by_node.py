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

from megaframe.parallel.rank_grid import node_refusal
from megaframe.planning.steptime.moe import expert_group, imbalance, spans_nodes


def node_split(s) -> tuple[int, int] | None:
    """(nodes N, ep ranks a node G) of the layout's expert group when its all-to-all goes by node and the
    group spans nodes; None where the plain all-to-all is planned (the same one inside a node)."""
    dev, lay, etp = s.dev, s.lay, s.cfg.parallel.etp
    if s.cfg.parallel.ep_dispatch != "node" or not spans_nodes(lay, etp, dev):
        return None
    if node_refusal(lay.tp, lay.dp, lay.ep, lay.cp, etp, dev.per_node) is not None:
        from megaframe.errors import ConfigError

        # the trainer refuses the layout on such nodes (parallel/launch.py dispatch_node): so does the plan
        raise ConfigError(
            f"parallel.ep_dispatch=node: ep={lay.ep} does not split into equal blocks of {dev.name}'s "
            f"{dev.per_node}-GPU nodes"
        )
    n, span = expert_group(lay, etp)
    local = max(dev.per_node // max(span // n, 1), 1)
    return n // local, local


def node_colls(rows: int, weights: int) -> int:
    """Collective kernels of the by-node all-to-alls a layer issues per micro-batch, given the plain
    dispatch's (steptime.timing._ep_colls): each of its row and weight exchanges runs twice, over the rail
    and inside the node, and the ids go over the rail once a forward."""
    return 2 * rows + 2 * weights + rows // 2 - 1


NODE_KERNELS = (23, 7)
"""(forward, backward) kernels model/moe/node_dispatch.py adds to a layer's micro-batch beyond the plain
dispatcher's (launches.moe_kernels), one an aten op other than a view, counted on the CPU by
tests/unit/planning/test_moe_step_terms.py (37 against the plain path's 14 forward, 21 against 14
backward): node_pairs (the assignments' nodes, zeros, scatter, not, the int8 cast, argsort), the pair
counts and split sizes, the pairs' tokens and nodes, their ids (gather, offset, two compares, and, where),
the ids' int32 cast and back, the weights' gather, the inner plan's own counts and sort, and the final
combine; backward, the pairs' gathers of rows and weights and the combine's."""


def _rail_seconds(dev, nodes: int, nbytes: float) -> float:
    """One all-to-all over the rail: nbytes leaving the rank over InfiniBand, a latency per other node."""
    return nbytes / (dev.inter_bw * dev.link_eff) + (nodes - 1) * dev.inter_latency_s


def _node_seconds(dev, local: int, nbytes: float) -> float:
    """One all-to-all inside the node: nbytes leaving the rank over NVLink, a latency per other rank."""
    return 0.0 if local == 1 else nbytes / (dev.intra_bw * dev.link_eff) + (local - 1) * dev.latency_s


def node_counts_seconds(s) -> float:
    """The by-node exchanges of expert counts ahead of the two host syncs (their latency, nothing hides
    it): the pairs a node gets over the rail (N int64), then a node's experts over the node (E/N int64)."""
    dev, e = s.dev, s.cfg.model.num_experts
    nodes, local = node_split(s)
    rail = _rail_seconds(dev, nodes, (nodes - 1) * 8)
    return rail + _node_seconds(dev, local, (local - 1) / local * e / nodes * 8)


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
    # the busiest node's pairs, as the plain all-to-all carries the busiest rank's rows
    pairs = routed / k / row * nodes_per_token(m, nodes) * (nodes - 1) / nodes * imbalance(m)
    inner = routed * imbalance(m) * (local - 1) / local
    # the ids go forward only, once a dispatch: one per forward (two where recompute re-runs it)
    ids = rows // 2 - 1
    t = rows * _rail_seconds(dev, nodes, pairs * row) + (ids + weights) * _rail_seconds(
        dev, nodes, pairs * k * 4
    )
    return t + rows * _node_seconds(dev, local, inner) + weights * _node_seconds(dev, local, inner / row * 4)
