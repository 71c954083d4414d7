"""Dispatch by node (parallel.ep_dispatch=node): a token crosses to another node once for all of its experts
there, then reaches each of them inside that node; the way back sums inside the node first.

Legend: T tokens on this rank, K top-k, N nodes of the ep group (mesh.ep_rail), G ep ranks a node
(mesh.ep_node), L experts a rank, LN = G·L experts a node, P (token, node) pairs this rank sends, R pairs
it receives, D hidden.

The plain dispatcher (moe/dispatcher.py) sends a row per (token, expert): a token whose K experts lie on
one other node crosses the slow link K times. Here the first all-to-all, over ep_rail (one ep rank per
node, each at this rank's place on its node), carries a row per (token, node it needs) with the token's
expert ids on that node (the others marked LN; int32) and their combine weights. On arrival the rows are
dispatched inside the node by the plain dispatcher over ep_node, as tokens whose marked assignments are
dropped ones (sorted last, cut before the row all-to-all), and it returns per received row the weighted
sum of that node's experts. The second all-to-all brings those partial sums back, and they are summed
per token: the same y as one process to float noise (only the summation order of a token's K terms
differs). DeepSeek-V3's report (sec. 3.2.2) sends its tokens so, and DeepEP and Megatron's HybridEP
dispatcher implement it in fused kernels; this is its plain torch form over two NCCL all-to-alls.

Dropless experts and etp = 1 only (parallel/layout_rules.py). Two host syncs per layer and micro-batch, where
the plain dispatch has one: each all-to-all's split sizes must be on the host before its rows move.
"""

from __future__ import annotations

import torch

from megaframe.model.moe import dispatcher, rows
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


def node_pairs(experts_TK: torch.Tensor, nodes: int, per_node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit_NT: whether token t has an expert on node n; order of the (node, token) pairs, node-major,
    the hits first). No host sync: the number of hits is read with the counts' sync."""
    t = experts_TK.shape[0]
    node_KT = (experts_TK // per_node).t()
    hit_NT = torch.zeros(nodes, t, dtype=torch.bool, device=experts_TK.device).scatter_(0, node_KT, True)
    # stable: a node's tokens stay in token order, so every layout sends them alike
    order = torch.argsort((~hit_NT).reshape(-1).to(torch.int8), stable=True)
    return hit_NT, order


def dispatch_combine_by_node(
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    rail: Axis,
    node: Axis,
    experts,
) -> torch.Tensor:
    """y_TD = sum over a token's K assignments of weight · expert(x_token), sent by node (module doc).
    `experts` as in dispatcher.dispatch_combine; rail and node: mesh.ep_rail and mesh.ep_node."""
    t = experts_TK.shape[0]
    per_node = num_experts // rail.size
    hit_NT, order = node_pairs(experts_TK, rail.size, per_node)
    send_N = hit_NT.sum(1)
    recv_N = comm.all_to_all_counts(send_N, rail)
    # the split sizes of the rail all-to-all: one host sync
    host = torch.cat([send_N, recv_N]).tolist()
    send, recv = host[: rail.size], host[rail.size :]
    pair_P = order[: sum(send)]
    token_P, node_P = pair_P % t, pair_P // t
    # the token's experts on the pair's node as that node's local ids; the others marked per_node (dropped)
    local_PK = experts_TK[token_P] - (node_P * per_node)[:, None]
    local_PK = torch.where((local_PK >= 0) & (local_PK < per_node), local_PK, per_node)
    x_RD = comm.all_to_all(rows.gather_rows(x_TD, token_P), rail, recv, send)
    # int32 on the wire (a node's expert ids are small): half the bytes of int64 ids
    local_RK = comm.all_to_all(local_PK.to(torch.int32), rail, recv, send).long()
    w_RK = comm.all_to_all(weights_TK[token_P], rail, recv, send)
    y_RD = dispatcher.dispatch_combine(x_RD, inner_plan(local_RK, w_RK, per_node), node, experts)
    y_PD = comm.all_to_all(y_RD, rail, send, recv)
    # sums a token's partial outputs from each node it went to
    return rows.scatter_rows(y_PD, token_P, t)


def inner_plan(local_RK: torch.Tensor, w_RK: torch.Tensor, per_node: int) -> dispatcher.Plan:
    """The received rows' assignments as a dispatcher.Plan over the node's experts: sorted by expert (the
    marked ones, id per_node, last: dropped, so the row all-to-all never carries them)."""
    k = local_RK.shape[1]
    flat_A = local_RK.reshape(-1)
    counts = dispatcher.expert_counts(flat_A, per_node + 1)
    order_A = torch.argsort(flat_A, stable=True)
    return dispatcher.Plan(order_A // k, w_RK.reshape(-1)[order_A], counts[:per_node], counts[per_node])
