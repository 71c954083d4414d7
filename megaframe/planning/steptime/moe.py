"""The step-time model's MoE parts (steptime.compute, steptime.timing): what a rank spends on its experts.

Placement as the trainer runs it (parallel/rank_grid.py): the experts fold each stage's tp·cp·dp ranks
as etp x ep x edp, etp innermost, so an ep group's members lie etp apart and it spans ep·etp consecutive
ranks (`expert_group`, read from the mesh's own rank arithmetic), each group holding every expert (E/ep a
rank, each split over etp). Each rank routes its own tokens (T = micro-batch x S/cp, 1/tp of them under sp).

  grouped GEMMs  a rank's experts receive T·top_k rows on average (dropless), IMBALANCE x that on the
                 busiest rank; each of its E/ep experts runs [rows / (E/ep), D] x [D, ffn] as one group of
                 moe/grouped.py's grouped GEMM: timed per expert on the size curve, each group with its own
                 fixed time, GROUPED_FIXED x the device's (fine-grained experts, e.g. 128 x 768, run far
                 below the peak a single [T·top_k, D] GEMM would reach). Per group, not as one large GEMM:
                 torch._grouped_mm in bf16 runs no faster than the loop of per-expert cuBLAS GEMMs it
                 replaces (pytorch/pytorch#163425, H200, 32 groups). GROUPED_FIXED is read off three
                 published measurements of Hopper grouped kernels, none of them a training run: 128 groups
                 of [512, 2048] x [2048, 1536] (Qwen3-30B-A3B's up projection) at 160.5 TFLOP/s on H100 in
                 CUTLASS's SM90 grouped kernel, torch._grouped_mm's (tgale96/grouped_gemm#37; the curve
                 gives 158 at 2, 261 at 1); torch._grouped_mm's fused MoE forward at Qwen3-30B-A3B's shape
                 (32768 tokens, D 2048, 128 experts of 768, top 8: 2048 rows a group) in 10.2 ms on H100
                 (ByteDance-Seed/VeOmni#460), which these GEMMs with the permutation's and SwiGLU's forward
                 passes below put at 10.5 ms at 2 (8.5 at 1); torch._grouped_mm at 256 groups of [1024,
                 6144] x [6144, 4096] at 603 TFLOP/s on a clock-bound H200 (tile-ai/TileOPs#1567; 603 at 2,
                 665 at 1). Measured on Hopper only: taken for every device with a grouped kernel (an
                 assumption). Without a Hopper
                 grouped kernel (no fp8 tensor cores here: A100; or fp32) the experts run moe/grouped.py's
                 padded path: the rows scattered into a zeroed [E/ep, rows, in] batch and gathered back
                 around each bmm (`padded_bytes`). The router's combine weights are applied inside the
                 experts (moe/grouped.py's weighted SwiGLU, silu recomputed in backward: `swiglu_bytes`).
  router         the router's fp32 [T, D] x [D, E] GEMM (forward, input and weight grads: x.float() and
                 F.linear in fp32, router.py) at the device's fp32 rate, the casts of x to fp32 and of its
                 grad back, and the passes over the fp32 [T, E] scores (`router_bytes`).
  permutation    the dispatcher's passes over the routed rows, counted op by op from
                 moe/dispatcher.py's dispatch_combine and moe/rows.py's backward (`permute_rows`): the
                 gather by token, the regrouping by local expert and back (ep > 1), the combine's
                 index_add into zeros, each an HBM read and write of its rows.
  all-to-all     4 per MoE layer and micro-batch of the busiest rank's routed rows (dispatch and combine,
                 forward and backward) and 2 of their fp32 combine weights, 4 bytes a row (dispatch,
                 forward and backward: the weights travel with their rows); a re-run forward repeats its
                 2 and 1. Each: (ep-1)/ep of them leaving the rank, on NVLink when the group is inside a
                 node, else the share bound for other nodes over InfiniBand (ep/node of the peers are
                 local), plus ep-1 steps of that link's latency. Under parallel.ep_dispatch=node with the
                 group across nodes, two stages instead (steptime/by_node.py).
  shared experts a dense MLP beside the routed ones (model.moe_shared_experts x the expert width, where
                 a family has them): a plain GEMM on every token.

IMBALANCE is an assumption, stated: the busiest expert rank's load over the mean under an auxiliary
load-balancing loss (Switch Transformer, Fedus et al. 2021, and GShard report per-expert loads within
~1.1-1.3 x of the mean once balanced; DeepSeek-V3's report the same order): 1.2. Under
model.moe_force_balance every expert takes the same rows (router.balanced_experts): 1 (`imbalance`).
"""

from __future__ import annotations

IMBALANCE = 1.2
"""Busiest rank's routed rows over the mean (module doc: an assumption with its sources)."""
GROUPED_FIXED = 2.0
"""A grouped GEMM's fixed time per group over a dense GEMM's (devices.gemm_fixed_s): module doc's sources."""


def imbalance(m) -> float:
    """The busiest rank's routed rows over the mean for this model (module doc)."""
    return 1.0 if getattr(m, "moe_force_balance", False) else IMBALANCE


def expert_group(lay, etp: int) -> tuple[int, int]:
    """(ranks in the expert group, consecutive global ranks it spans) as the mesh folds it."""
    from megaframe.parallel.rank_grid import folded_expert_groups

    return lay.ep, folded_expert_groups(lay.tp, lay.cp, lay.dp, lay.ep, etp, lay.shard_size).ep_span


def spans_nodes(lay, etp: int, dev) -> bool:
    """Whether the layout's expert group reaches beyond one of the device's nodes (its all-to-all then
    crosses InfiniBand); never on the cpu, which has no nodes."""
    return lay.ep > 1 and not dev.name.startswith("cpu") and expert_group(lay, etp)[1] > dev.per_node


def expert_gemms(m, tp: int) -> tuple[tuple[int, int], ...]:
    """(k, n) of one expert's up (gate fused under swiglu) and down projections on a tp rank."""
    d, f = m.hidden_size, m.expert_ffn
    up = (2 if "swiglu" in str(getattr(m.activation, "value", m.activation)) else 1) * f
    return ((d, up // tp), (f // tp, d))


def expert_rows(m, tokens: int, ep: int) -> float:
    """Rows one local expert of the busiest rank multiplies in a micro-batch (module doc)."""
    return imbalance(m) * tokens * m.moe_top_k * ep / m.num_experts


def experts_seconds(gemm_seconds, dev, prec: str, m, tokens: int, tp: int, ep: int) -> float:
    """Forward seconds of the rank's experts: E/ep grouped GEMM groups on the size curve, plus a shared
    expert's dense GEMMs where the model has one."""
    rows = max(1, round(expert_rows(m, tokens, ep)))
    local = m.num_experts // ep
    # the padded path's bmm is one batched GEMM of equal groups: the dense curve's fixed time
    fixed = GROUPED_FIXED if grouped_kernel(dev, prec) else 1.0
    t = local * sum(gemm_seconds(dev, prec, rows, k, n, fixed) for k, n in expert_gemms(m, tp))
    # DeepSeek's shared experts: one dense SwiGLU of moe_shared_experts x the expert width on every token
    shared = (getattr(m, "moe_shared_experts", 0) or 0) * m.expert_ffn
    if shared:
        t += gemm_seconds(dev, prec, tokens, m.hidden_size, 2 * shared // tp)
        t += gemm_seconds(dev, prec, tokens, shared // tp, m.hidden_size)
    return t


def router_bytes(m, tokens: int, elem: int) -> float:
    """HBM bytes of the router's work beside its GEMM, forward + backward, counted from router.py and
    MoE.forward: x cast to fp32 (read elem, write 4 a [T, D] element), in forward and again in backward (the
    gate keeps x as it came, not its fp32 copy), and its fp32 grad cast back and added
    to the experts' grad of x (read 4, write elem; read 2 x elem, write elem); over the fp32 [T, E] scores,
    forward: softmax (read, write), top-k (read), the aux loss's sum over tokens (read), the logged
    entropy (clamp, log: read and write each; the product: two reads, a write; the sum: a read), the
    z-loss's logsumexp (a read) where its coefficient is set; backward: the chosen scores' grad scattered
    into zeros (a write), added to the aux loss's (two reads, a write), the softmax's backward (two reads,
    a write)."""
    d, e = m.hidden_size, m.num_experts
    casts = tokens * d * (2 * (elem + 4) + (4 + elem) + 3 * elem)
    z = getattr(m, "moe_z_loss_coeff", 0) or 0
    scores = (2 + 1 + 1 + 2 + 2 + 3 + 1 + (1 if z > 0 else 0)) + (1 + 3 + 3)
    return casts + tokens * e * 4 * scores


def permute_rows(m, tokens: int, ep: int) -> float:
    """Rows (of D elements) the dispatcher's permutation reads plus writes for one MoE layer and micro-batch,
    forward + backward, on the busiest rank (moe/dispatcher.py's dispatch_combine with moe/rows.py's row
    moves; A = T·top_k assignments of the rank's own tokens, R = imbalance(m) x A rows its experts receive
    when ep > 1). Forward: the gather by token, x_TD[token_A] (read A, write A); under ep the regrouping's
    gather x_RD[perm_R] (read R, write R) and its inverse, a scatter_rows: zeros (write R) and index_add_
    (read a source row, read and write its target row: 3R); the combine, a scatter_rows into [T, D]: zeros
    (write T) and index_add_ (3A). Backward (rows.py's): the combine's index_select (read A, write A); under
    ep the inverse's index_select (2R) and the regrouping's zeros and accumulating index_put_ (R + 3R); the
    gather by token's zeros and index_put_ (T + 3A). The combine weight is applied inside the experts
    (`swiglu_bytes`); its own moves (the [A, 1] fp32 weights gathered, regrouped and their grads: 4 bytes a
    row, not D elements) are left out."""
    a = tokens * m.moe_top_k
    r = imbalance(m) * a if ep > 1 else 0.0
    forward = 2 * a + (2 * r + 4 * r) + tokens + 3 * a
    backward = 2 * a + (2 * r + 4 * r) + tokens + 3 * a
    return forward + backward


def swiglu_bytes(m, tokens: int, ep: int, elem: int) -> float:
    """HBM bytes of the experts' weighted SwiGLU between their two grouped GEMMs (moe/grouped.py's
    _WeightedSwiGLU), forward + backward, on the busiest rank's routed rows (F elements each side of the
    [rows, 2F] up output; the [rows, 1] fp32 combine weight's own reads and casts, 4 bytes a row, left
    out). Eager ops: the rest of the layer's forward reads the split sizes the host sync returned (Python
    ints that change every step, under compile_blocks' dynamic=False a recompile each, so torch.compile
    gives up on that frame). Forward: silu of the gate view (read F, write F), its product with up (read
    2F, write F), that times the weight (read F, write F): 7F. Backward, silu recomputed from the saved
    [gate | up]: sigmoid (read F, write F), silu = gate · sig (read 2F, write F), dh · w (read F, write
    F), the gate's grad (dh·w) · up · (sig · (1 + gate · (1 - sig))): four products of two F operands
    (read 2F, write F each) and 1 - sig, 1 + ... (read F, write F each), the up grad (dh·w) · silu (read
    2F, write F), the two grads concatenated into [rows, 2F] (read 2F, write 2F): 30F; and the weight's
    grad: silu · up (read 2F, write F), its product with dh (read 2F, write F), the sum over F in fp32
    (read F): 7F."""
    rows = tokens * m.moe_top_k * (imbalance(m) if ep > 1 else 1.0)
    forward = (2 + 3 + 2) * elem
    backward = (2 + 3 + 2 + (4 * 3 + 2 * 2) + 3 + 4) * elem
    weight_grad = (3 + 3 + 1) * elem
    return rows * m.expert_ffn * (forward + backward + weight_grad)


def padded_bytes(m, tokens: int, ep: int, elem: int) -> float:
    """HBM bytes of moe/grouped.py's padded path around the experts' two bmm's, forward + backward (module
    doc), per projection (in D out 2F, then in F out D) of its [E/ep, M, in] batch (M: the busiest
    expert's rows, expert_rows) and the routed rows. Forward: the batch zeroed (write), index_put (out of
    place: the zeros cloned, read and write, then a row per routed row, read and write), the output rows
    gathered back (read, write). Backward: that gather's grad, zeros of [E/ep, M, out] (write) and an
    accumulating index_put (read a grad row, read and write its target); the index_put's grad of the rows,
    a gather (read, write; the zeros take no grad)."""
    f, d, local = m.expert_ffn, m.hidden_size, m.num_experts // ep
    rows = tokens * m.moe_top_k * (imbalance(m) if ep > 1 else 1.0)
    pad = local * expert_rows(m, tokens, ep)
    forward = sum(3 * pad * i + 2 * rows * i + 2 * rows * o for i, o in ((d, 2 * f), (f, d)))
    backward = sum(pad * o + 3 * rows * o + 2 * rows * i for i, o in ((d, 2 * f), (f, d)))
    return (forward + backward) * elem


def grouped_kernel(dev, prec: str) -> bool:
    """Whether the trainer's experts run torch._grouped_mm (moe/grouped.py: bf16 on sm90+; fp8 tensor
    cores mark Hopper and later in the device table) rather than the padded bmm."""
    return prec != "fp32" and bool(dev.peak_fp8)


def all_to_all_seconds(s, routed_bytes: float) -> float:
    """Seconds of one all-to-all of a rank's routed rows over its expert group (module doc); s: the
    steptime.inputs.Step (its device, layout and link model)."""
    dev, lay = s.dev, s.lay
    n, span = expert_group(lay, s.cfg.parallel.etp)
    if n <= 1:
        return 0.0
    out = (n - 1) / n * routed_bytes * imbalance(s.cfg.model)
    if not spans_nodes(lay, s.cfg.parallel.etp, dev):
        return s.coll(out, n, n - 1, span)
    # group peers on this node: members lie span / n apart
    local = max(dev.per_node // max(span // n, 1), 1)
    off = (n - local) / (n - 1) * out
    on = out - off
    intra = on / (dev.intra_bw * dev.link_eff) + (local - 1) * dev.latency_s
    inter = off / (dev.inter_bw * dev.link_eff) + (n - local) * dev.inter_latency_s
    return max(intra, inter)
