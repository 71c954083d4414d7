"""The step-time model's MoE terms (planning.steptime.moe, compute, launches) held to hand counts of what the
trainer's model/moe/ code does per layer and micro-batch, and where a float32 GEMM runs (the MoE router's,
and every GEMM of an fp32 run): on the CUDA cores, megaframe never allowing TF32."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from megaframe.config import load_config
from megaframe.planning.devices import DEVICES
from megaframe.planning.steptime import compute, launches, moe

# D 4, E 8 experts of width 6, top 2: small enough to count by hand
M = SimpleNamespace(hidden_size=4, num_experts=8, expert_ffn=6, moe_top_k=2, moe_z_loss_coeff=0.0)


@pytest.fixture(scope="module")
def cfg():
    """moe_tiny composed once for the tests that time its collectives."""
    return load_config(["data=synthetic", "model=moe_tiny"], world_size=1, check_data=False)


def test_the_permutation_rows_are_the_dispatchers_passes():
    # 10 tokens, top 2: A = 20 assignments. Forward: the gather by token 2A, the combine's zeros T and
    # index_add_ 3A (no weight multiply: the experts apply it); backward (moe/rows.py): the combine's
    # index_select 2A, the gather's zeros T and accumulating index_put_ 3A
    assert moe.permute_rows(M, 10, 1) == (2 + 3) * 20 + 10 + (2 + 3) * 20 + 10
    # under ep the busiest rank's R = 1.2 A = 24 rows: forward the regrouping's gather 2R and its inverse's
    # zeros R and index_add_ 3R; backward the inverse's index_select 2R, the gather's zeros R, index_put_ 3R
    assert moe.permute_rows(M, 10, 8) == moe.permute_rows(M, 10, 1) + (2 + 1 + 3) * 24 + (2 + 1 + 3) * 24


def test_the_router_bytes_are_its_casts_and_score_passes():
    # x to fp32 in forward and again in backward (the gate keeps bf16 x), the grad back and the grads' add
    # (bf16): 2 x (2 + 4) + (4 + 2) + 3 x 2 = 24 bytes a [T, D] element;
    # [T, E] fp32 passes: 12 forward (softmax 2, top-k, the aux sum, entropy 2 + 2 + 3 + 1) + 7 backward
    assert moe.router_bytes(M, 10, 2) == 24 * 10 * 4 + 19 * 10 * 8 * 4
    z = SimpleNamespace(**{**vars(M), "moe_z_loss_coeff": 1e-3})  # the z-loss's logsumexp: one more read
    assert moe.router_bytes(z, 10, 2) == moe.router_bytes(M, 10, 2) + 10 * 8 * 4


def test_the_padded_path_is_charged_where_no_grouped_kernel_runs():
    # 10 tokens, ep 2: 4 local experts, 24 routed rows, the busiest expert's 6 rows: a [4, 6, in] batch
    # per projection (in 4 out 12, in 6 out 4). Forward: zeroed (24 x in), index_put's clone of it (read
    # and write), the 24 rows put (read, write), the 24 output rows gathered back (read, write)
    fwd = (3 * 24 * 4 + 48 * 4 + 48 * 12) + (3 * 24 * 6 + 48 * 6 + 48 * 4)
    # backward: the gather's grad, zeros [4, 6, out] and an accumulating index_put (read a row, read and
    # write its target); the put rows' grad gathered (read, write)
    bwd = (24 * 12 + 72 * 12 + 48 * 4) + (24 * 4 + 72 * 4 + 48 * 6)
    assert moe.padded_bytes(M, 10, 2, 2) == (fwd + bwd) * 2
    h100, a100 = DEVICES["H100"], DEVICES["A100"]
    assert moe.grouped_kernel(h100, "bf16") and not moe.grouped_kernel(a100, "bf16")
    assert not moe.grouped_kernel(h100, "fp32")
    base = moe.router_bytes(M, 10, 2) + moe.permute_rows(M, 10, 2) * 4 * 2 + moe.swiglu_bytes(M, 10, 2, 2)
    assert compute.moe_bytes(M, h100, "bf16", 10, 2) == base
    assert compute.moe_bytes(M, a100, "bf16", 10, 2) == base + moe.padded_bytes(M, 10, 2, 2)


def test_the_moe_kernels_are_counted_per_op_and_grow_under_ep():
    # forward: router 3, route 6, counts 3, plan 4, dispatch 8, the weighted SwiGLU 4, losses 9,
    # statistics 18; backward: router 5, route 10, aux loss 6, dispatch 10, the weighted SwiGLU 15
    assert launches.moe_kernels(1) == (3 + 6 + 3 + 4 + 8 + 4 + 9 + 18, 5 + 10 + 6 + 10 + 15)
    # ep adds the counts' all-to-all, the regrouping (arange, repeat, repeat_interleave 2, sort, the rows'
    # and the weights' gathers) and its inverse (zeros, index_add): 10; backward the inverse's
    # index_select and each gather's zeros, sort and index_put: 7
    assert launches.moe_kernels(8) == (55 + 10, 46 + 7)


def test_an_moe_blocks_activation_is_its_experts_weighted_swiglu():
    # eager forward: 2 norms, 2 grouped GEMMs, attention, RoPE 10 and v's copy, 2 residual adds (the MLP's
    # SwiGLU is the experts', in moe_kernels); backward: 4 GEMMs, 4 weight-grad adds, attention 3, norms 4,
    # RoPE 10, residual grads 2
    m = SimpleNamespace(**vars(M), activation="swiglu", position_embedding="rope", dropout=0.0)
    f, b = launches.moe_kernels(1)
    assert launches.block_kernels(m, False, 0) == (2 + 2 + 1 + 10 + 1 + 2 + f) + (4 + 4 + 3 + 4 + 10 + 2 + b)
    # q/k norms keep their views of the [q | k | v] output, and the cp all-gather makes a new V: not copied
    qk = SimpleNamespace(**vars(m), qk_norm=True)
    assert launches.block_kernels(qk, False, 0) == launches.block_kernels(m, False, 0) - 1
    assert launches.block_kernels(m, False, 0, cp_gathered=True) == launches.block_kernels(m, False, 0) - 1
    # compiled: the norm, RoPE and residual+norm regions (3 each way; the activation runs eagerly)
    assert launches.block_kernels(m, True, 0) == (2 + 1 + 3 + f) + (4 + 4 + 3 + 3 + 2 + b)


def test_the_experts_swiglu_runs_eagerly_on_the_busiest_ranks_rows():
    # 10 tokens, top 2, ep 2: 24 rows of F = 6, bf16. Forward: silu 2F, x up 3F, x the weight 2F. Backward
    # (silu recomputed): sigmoid 2F, silu 3F, dh·w 2F, the gate's grad (four products 3F, two one-operand
    # ops 2F), the up grad 3F, the concatenation 4F; bytes a row and F:
    fwd, bwd = 7 * 2, (2 + 3 + 2 + 12 + 4 + 3 + 4) * 2
    # the weight's grad: silu·up (3 x 2), its product with dh (3 x 2), the sum in fp32 reading it (2)
    dw = 3 * 2 + 3 * 2 + 2
    assert moe.swiglu_bytes(M, 10, 2, 2) == 24 * 6 * (fwd + bwd + dw)
    assert moe.swiglu_bytes(M, 10, 1, 2) == 20 * 6 * (fwd + bwd + dw)  # no ep: the rank's own 20 rows
    # fp32: 4 bytes an element
    assert moe.swiglu_bytes(M, 10, 1, 4) == 20 * 6 * (7 * 4 + 30 * 4 + 7 * 4)


def test_the_router_gemm_runs_in_fp32_on_the_cuda_cores():
    args = ["data=synthetic", "model=moe_tiny", "train.precision=bf16"]
    cfg = load_config(args, world_size=1, check_data=False)
    h100, b200 = DEVICES["H100"], DEVICES["B200"]
    assert h100.peak("fp32_cores") == 67e12 and b200.peak("fp32_cores") == b200.peak_fp32
    tf32 = dataclasses.replace(h100, peak_fp32_cores=0.0)  # unknown: the TF32 figure stands in
    m, mb = cfg.model, cfg.train.micro_batch_size
    t = mb * m.seq_length
    one = [compute.gemm_seconds(d, "fp32_cores", t, m.hidden_size, m.num_experts) for d in (h100, tf32)]
    gemm = [compute.block_seconds(cfg, d, 1, 1, mb, False)["gemm"] for d in (h100, tf32)]
    # forward, input grad and weight grad of the [T, D] x [D, E] router GEMM
    assert one[0] > one[1]
    assert gemm[0] - gemm[1] == pytest.approx(compute.PASSES * (one[0] - one[1]))


def test_an_fp32_runs_gemms_and_mfu_are_timed_on_the_cuda_cores():
    """train.precision=fp32 on a GPU: its GEMMs run at torch's "highest" float32 precision (no TF32), ~15x
    below the bf16 peak on an H100; they were timed at the TF32 peak (half the bf16 one)."""
    h100 = DEVICES["H100"]
    assert h100.peak("fp32") == h100.peak("fp32_cores") == 67e12 and h100.peak("tf32") == h100.peak_fp32
    gemm = {}
    for prec in ("fp32", "bf16"):
        args = ["data=synthetic", "model=llama3_8b", "model.num_layers=1", f"train.precision={prec}"]
        c = load_config(args, world_size=1, check_data=False)
        gemm[prec] = compute.block_seconds(c, h100, 1, 1, c.train.micro_batch_size, False)["gemm"]
    # 8B's GEMMs are compute-bound: the ratio is the peaks' (the bytes move it a little)
    assert gemm["fp32"] / gemm["bf16"] == pytest.approx(h100.peak_bf16 / 67e12, rel=0.05)


@pytest.mark.parametrize("ep", [8, 16])
def test_the_all_to_all_rides_the_link_its_expert_group_lands_on(ep, cfg):
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime.inputs import Step

    h100 = DEVICES["H100"]
    s = Step(cfg, Layout(1, 1, 1, ep, ep, 1, 1, "none"), h100, ep)
    nv, ib = h100.intra_bw * h100.link_eff, h100.inter_bw * h100.link_eff
    out = (ep - 1) / ep * 1e6 * moe.IMBALANCE  # the busiest rank's rows leaving it
    if ep == 8:  # tp·cp·dp ranks fold ep innermost: 8 consecutive ranks, one node, NVLink
        want = out / nv + 7 * h100.latency_s
    else:  # 16 ranks over two nodes: 7 of the 15 peers on NVLink, 8 over InfiniBand
        want = max(7 / 15 * out / nv + 7 * h100.latency_s, 8 / 15 * out / ib + 8 * h100.inter_latency_s)
    assert moe.all_to_all_seconds(s, 1e6) == pytest.approx(want, rel=1e-12)


def test_the_counts_collectives_ahead_of_the_host_sync_pay_their_latency(cfg):
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime.inputs import Step
    from megaframe.planning.steptime.timing import _moe_count_colls

    h100, e = DEVICES["H100"], cfg.model.num_experts
    nv = h100.intra_bw * h100.link_eff
    assert _moe_count_colls(Step(cfg, Layout(1, 1, 1, 8, 1, 1, 1, "none"), h100, 8)) == 0.0
    # tp 2 under sp: one run's int64 counts all-gathered from the one peer, one ring step
    sp = Step(cfg, Layout(2, 1, 1, 4, 1, 1, 1, "none", sp=True), h100, 8)
    assert _moe_count_colls(sp) == pytest.approx(8 * e / nv + h100.latency_s, rel=1e-12)


def test_the_combine_weights_travel_in_their_own_all_to_all(cfg):
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime.inputs import Step
    from megaframe.planning.steptime.timing import _ep, _ep_colls

    m, h100 = cfg.model, DEVICES["H100"]
    s = Step(cfg, Layout(1, 1, 1, 8, 8, 1, 1, "none"), h100, 8)
    rows = s.lay.micro_batch * m.seq_length * m.moe_top_k  # the rank's routed rows a micro-batch
    # the rows' dispatch and combine, forward and backward (D elements each), and the fp32 weights'
    # dispatch, forward and backward (4 bytes a row), each with its own latency
    a2a = moe.all_to_all_seconds
    one = 4 * a2a(s, rows * m.hidden_size * s.elem) + 2 * a2a(s, rows * 4)
    assert _ep(s) == pytest.approx(s.layers * s.micro * one, rel=1e-12)
    # each a collective launch; a re-run forward repeats the rows' 2 and the weights' 1
    assert _ep_colls(s.lay) == (4, 2)
    assert _ep_colls(dataclasses.replace(s.lay, recompute="full")) == (6, 3)


def test_the_dense_grads_pay_the_latency_of_their_own_buckets_only(cfg, monkeypatch):
    """The experts' grads are a buffer of their own (optim/buffer.py's bucket_plan per buffer): with ep over
    every dp rank they have no dp collective, so (the compute that hides it held fixed) the dp time cannot
    grow with the experts' size; counting the dense ring's buckets over every parameter charged it a
    bucket's latency per expert bucket too."""
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime import timing
    from megaframe.planning.steptime.inputs import Step
    from megaframe.planning.steptime.timing import _dp

    monkeypatch.setattr(timing, "_compute", lambda s: 1e-3)

    lay, h100 = Layout(1, 1, 1, 8, 8, 1, 1, "none"), DEVICES["H100"]

    def dp(width: int) -> float:
        m = dataclasses.replace(cfg.model, moe_ffn_hidden_size=width)
        small = dataclasses.replace(cfg.optim, bucket_size_mb=0.01)  # many buckets: their latency shows
        return _dp(Step(dataclasses.replace(cfg, model=m, optim=small), lay, h100, 8))

    assert dp(cfg.model.expert_ffn) > 0
    assert dp(4 * cfg.model.expert_ffn) == pytest.approx(dp(cfg.model.expert_ffn), rel=1e-12)


def test_the_grouped_gemms_meet_the_published_kernel_measurements():
    """moe.GROUPED_FIXED against what it was read off (moe.py's doc): three published timings of Hopper
    grouped GEMMs, none a training run. The dense curve's fixed time (1) puts the first two 1.6 x and 1.2 x
    too fast."""
    h100, h200 = DEVICES["H100"], DEVICES["H200"]
    g = moe.GROUPED_FIXED
    # tgale96/grouped_gemm#37: 128 groups of [512, 2048] x [2048, 1536] at 160.5 TFLOP/s
    t = compute.gemm_seconds(h100, "bf16", 512, 2048, 1536, g)
    assert 2 * 512 * 2048 * 1536 / t / 1e12 == pytest.approx(160.5, rel=0.05)
    # ByteDance-Seed/VeOmni#460: Qwen3-30B-A3B's fused MoE forward, 32768 tokens, top 8, in 10.2 ms: the
    # experts' two grouped GEMMs at 2048 rows a group, the permutation's and the SwiGLU's forward passes
    tokens, rows = 32768, 32768 * 8
    gemms = 128 * sum(
        compute.gemm_seconds(h100, "bf16", 2048, k, n, g) for k, n in ((2048, 1536), (768, 2048))
    )
    # the permutation's forward is half its rows (ep 1); the SwiGLU's forward 7 bf16 passes of F a row
    top8 = SimpleNamespace(moe_top_k=8)
    passes = moe.permute_rows(top8, tokens, 1) / 2 * 2048 * 2 + 7 * rows * 768 * 2
    assert (gemms + compute._stream(h100, passes)) * 1e3 == pytest.approx(10.2, rel=0.05)
    # tile-ai/TileOPs#1567: torch._grouped_mm, 256 groups of [1024, 6144] x [6144, 4096], 603 TFLOP/s (H200)
    t = compute.gemm_seconds(h200, "bf16", 1024, 6144, 4096, g)
    assert 2 * 1024 * 6144 * 4096 / t / 1e12 == pytest.approx(603, rel=0.05)


def test_zero3_hides_a_blocks_dense_and_expert_collectives_behind_that_block(cfg, monkeypatch):
    """ZeRO-3's overlap unit is a block: its dense and its experts' gathers and reduce-scatters run during
    the same block's compute, so with every collective costing 1 s and all hidden but the last unit's, the
    exposed tail is one block's four (gather and reduce-scatter, dense and expert) plus the re-gather of
    reshard_after_forward, not half of that, as counting the experts' buckets as units of their own gave."""
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime import timing
    from megaframe.planning.steptime.inputs import Step
    from megaframe.planning.steptime.timing import _dp

    monkeypatch.setattr(timing, "_compute", lambda s: 1e9)  # every unit's traffic hidden but the tail
    monkeypatch.setattr(Step, "coll", lambda self, nbytes, n, steps, span: 1.0)
    s = Step(cfg, Layout(1, 1, 1, 8, 2, 3, 1, "none"), DEVICES["H100"], 8)
    assert timing._experts(s).edp_shard > 1  # the experts do have a dp collective here
    units = (s.layers + 1) * s.micro
    # per micro-batch a gather and a reduce-scatter of each unit, dense and expert: 2 colls a ring call
    gather, reduce = 2 * s.micro / units, 2 * s.micro / units
    assert _dp(s) == pytest.approx(gather + reduce + gather)


def test_a_force_balanced_run_is_timed_at_even_load(monkeypatch):
    """model.moe_force_balance routes every expert the same rows (router.balanced_experts): its plan is the
    plan of a trained router with the busiest rank at the mean load, IMBALANCE 1 in every MoE term (the
    experts' GEMMs, the permutation, the SwiGLU, the all-to-alls), faster than a trained one's 1.2."""
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime.timing import step_time

    over = ["data=synthetic", "model=qwen3_30b_a3b", "train.global_batch_size=64", "train.precision=bf16"]
    trained, forced = (
        load_config(over + extra, world_size=8, check_data=False)
        for extra in ([], ["model.moe_force_balance=true"])
    )
    lay = Layout(1, 1, 1, 8, 8, 1, 1, "none")
    planned = step_time(forced, lay, DEVICES["H100"], 8)
    assert sum(planned.values()) < sum(step_time(trained, lay, DEVICES["H100"], 8).values())
    monkeypatch.setattr(moe, "IMBALANCE", 1.0)
    assert step_time(trained, lay, DEVICES["H100"], 8) == pytest.approx(planned, rel=1e-12)


def test_the_nodes_a_token_needs_are_the_routing_rules():
    """steptime.by_node's distinct nodes per token: under forced balance the trainer's own rule
    (router.balanced_experts) counted over its period; else k experts drawn alike (the closed form)."""
    import itertools
    import math

    import torch

    from megaframe.model.moe.router import balanced_experts
    from megaframe.planning.steptime.by_node import nodes_per_token

    for e, k, nodes in ((128, 8, 2), (256, 8, 4), (8, 2, 2), (128, 4, 8)):
        experts_EK = balanced_experts(torch.arange(e), k, e)
        counted = sum(len(set((row // (e // nodes)).tolist())) for row in experts_EK) / e
        forced = SimpleNamespace(num_experts=e, moe_top_k=k, moe_force_balance=True)
        assert nodes_per_token(forced, nodes) == counted
    trained = SimpleNamespace(num_experts=8, moe_top_k=2, moe_force_balance=False)
    by_hand = sum(len({a // 4, b // 4}) for a, b in itertools.combinations(range(8), 2)) / math.comb(8, 2)
    assert nodes_per_token(trained, 2) == pytest.approx(by_hand)


def test_dispatch_by_node_crosses_infiniband_once_per_token_and_node():
    """parallel.ep_dispatch=node with the expert group over two 8-GPU nodes (Qwen3-30B-A3B's ep16): the rail
    all-to-all carries a row per (token, other node) where the plain one carries a row per (token, expert
    off the node), so its ep part is smaller; inside one node the two are the same all-to-all."""
    from megaframe.planning.candidate import Layout
    from megaframe.planning.steptime.timing import step_time

    over = ["data=synthetic", "model=qwen3_30b_a3b", "train.global_batch_size=64", "train.micro_batch_size=1"]
    plain, node = (
        load_config(over + extra, world_size=16, check_data=False)
        for extra in ([], ["parallel.ep_dispatch=node"])
    )
    across, inside = Layout(1, 1, 1, 16, 16, 1, 1, "none"), Layout(1, 1, 1, 16, 8, 1, 1, "none")
    h100 = DEVICES["H100"]
    ep_plain, ep_node = (step_time(c, across, h100, 16)["ep"] for c in (plain, node))
    # over InfiniBand a token's rows: plain 8 x 8/16 off the node at 1.2 x the mean load, 4.8; by node 1.99
    # nodes x 1/2 (+ its ids and weights), 4.8 x fewer; but the node's NVLink stage, the routed rows at
    # 7/8 off the rank, runs after the rail's (two all-to-alls, moe/node_dispatch.py): about 2.4 x in all
    assert 2 < ep_plain / ep_node < 3
    assert step_time(node, inside, h100, 16) == step_time(plain, inside, h100, 16)


def test_dispatch_by_node_issues_the_kernels_the_planner_adds():
    """by_node.NODE_KERNELS is the by-node path's aten ops beyond the plain dispatcher's (views aside),
    counted on one process (the all-to-alls of size-1 axes are free: only the row and index work counts)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megaframe.model.moe import dispatcher, node_dispatch
    from megaframe.parallel.mesh import single_process_mesh
    from megaframe.planning.steptime.by_node import NODE_KERNELS

    views = {"view", "_unsafe_view", "t", "reshape", "slice", "expand", "unsqueeze", "squeeze", "alias"}
    views |= {"detach", "select", "as_strided", "transpose", "permute", "split"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.__name__.split(".")[0] not in views
            return func(*args, **(kwargs or {}))

    ax, (t, e, d) = single_process_mesh().ep, (64, 8, 16)
    x = torch.randn(t, d, requires_grad=True)
    logits = torch.randn(t, e, requires_grad=True, generator=torch.Generator().manual_seed(0))
    counts = []
    for by_node in (False, True):
        w_TK, e_TK = torch.softmax(logits, -1).topk(2)
        with Ops() as fwd:
            if by_node:
                y = node_dispatch.dispatch_combine_by_node(x, e_TK, w_TK, e, ax, ax, lambda r, s, n, w: r * w)
            else:
                y = dispatcher.dispatch_combine(
                    x, dispatcher.plan(e_TK, w_TK, e), ax, lambda r, s, n, w: r * w
                )
        with Ops() as bwd:
            y.sum().backward()
        counts.append((fwd.n, bwd.n))
    (f0, b0), (f1, b1) = counts
    assert (f1 - f0, b1 - b0) == NODE_KERNELS, counts


def test_a_by_node_layout_the_nodes_cannot_cut_evenly_is_refused_by_plan_and_search(capsys):
    """96 experts at ep12 on 8-GPU nodes: the ep group's 12 ranks hold 8 on one node and 4 on the next,
    which the trainer refuses at launch; `plan` says so in one line (exit 2) rather than time a rail of one
    node, and the search leaves such ep sizes out."""
    from megaframe.plan import main
    from megaframe.planning.search.candidates import candidates

    over = ["data=synthetic", "model=moe_tiny", "model.num_experts=96", "train.global_batch_size=48"]
    over += ["train.micro_batch_size=1"]
    node = ["parallel.ep_dispatch=node", "+world_size=48", "+device=H100"]
    assert main([*over, "parallel.ep=12", *node]) == 2
    assert "does not split into equal blocks" in capsys.readouterr().err
    cfg = load_config([*over, "parallel.ep_dispatch=node"], world_size=48, check_data=False)
    keep = lambda lay: lay.tp == lay.pp == lay.cp == 1 and lay.zero == 1 and lay.recompute == "none"  # noqa: E731
    eps = {lay.ep for lay in candidates(cfg, 48, 8, keep=keep)}
    assert 8 in eps and 16 in eps and 12 not in eps and 6 not in eps, sorted(eps)
