"""MoE pieces in one process: routing and router losses against hand-computed values, capacity and
dropping, the layer against a per-token loop, per-expert init, and the imbalance figures."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megaframe.config import load_config
from megaframe.layers.shard import full_init
from megaframe.model.moe import dispatcher, router, stats
from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import TINY
from tests.distributed.moe_cases import MOE, _layer
from tests.forms import build_model, train_step

torch.set_num_threads(1)


@functools.lru_cache(maxsize=None)
def cfg_of(*extra):
    # a Hydra compose each: once per set of overrides (the config is frozen, so tests can share it)
    return load_config(TINY + MOE + list(extra), world_size=1, check_data=False)


def test_softmax_top2_renormalised():
    r = router.route(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 2)
    assert r.experts_TK.tolist() == [[0, 1]]
    e2, e1 = math.exp(2), math.exp(1)
    torch.testing.assert_close(r.weights_TK, torch.tensor([[e2 / (e2 + e1), e1 / (e2 + e1)]]))
    z = sum(math.exp(v) for v in (2, 1, 0, -1))
    torch.testing.assert_close(r.probs_TE, torch.tensor([[math.exp(v) / z for v in (2, 1, 0, -1)]]))


def test_sigmoid_scores_and_bias_selects_only():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.5, -1.0)]
    r = router.route(logits, 2, "sigmoid")
    assert r.experts_TK.tolist() == [[0, 1]]
    torch.testing.assert_close(r.weights_TK, torch.tensor([[s[0] / (s[0] + s[1]), s[1] / (s[0] + s[1])]]))
    torch.testing.assert_close(r.probs_TE, torch.tensor([[v / sum(s) for v in s]]))
    # the bias moves the choice off expert 0; the weights are still the unbiased scores
    biased = router.route(logits, 2, "sigmoid", torch.tensor([-10.0, 0.0, 0.0, 0.0]))
    assert biased.experts_TK.tolist() == [[1, 2]]
    torch.testing.assert_close(
        biased.weights_TK, torch.tensor([[s[1] / (s[1] + s[2]), s[2] / (s[1] + s[2])]])
    )


def test_aux_and_z_loss_by_hand():
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.5, 0.5, 3.0], [0.0, 0.0, 0.0]])
    r = router.route(logits, 1)
    counts = torch.bincount(r.experts_TK.reshape(-1), minlength=3)
    assert counts.tolist() == [2, 1, 1]  # the all-zero row ties: the lowest index wins
    p = torch.softmax(logits, -1)
    want = 3 * sum((counts[e].item() / 4) * p[:, e].mean().item() for e in range(3))
    assert router.load_balancing_loss(r.probs_TE, counts, 4, 1).item() == pytest.approx(want, rel=1e-6)
    want_z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 4
    assert router.z_loss(logits, 4).item() == pytest.approx(want_z, rel=1e-6)
    uniform = torch.full((8, 4), 0.25)
    assert router.load_balancing_loss(uniform, torch.full((4,), 4), 8, 2).item() == pytest.approx(1.0)


def test_capacity_keeps_the_first_assignments_in_token_order():
    experts = torch.tensor([[0], [0], [1], [0], [0]])
    p = dispatcher.plan(experts, torch.ones(5, 1), 2, capacity=2)
    assert p.token_A[:3].tolist() == [0, 1, 2] and p.kept_E.tolist() == [2, 1] and p.dropped.item() == 2
    assert sorted(p.token_A[3:].tolist()) == [3, 4]  # the dropped ones, after the kept
    # an earlier sequence block (another tp rank under sp) already filled one slot of expert 0
    p = dispatcher.plan(experts, torch.ones(5, 1), 2, capacity=2, offset_E=torch.tensor([1, 0]))
    assert p.kept_E.tolist() == [1, 1] and p.token_A[:2].tolist() == [0, 2] and p.dropped.item() == 3


def _layer_outputs(cfg, x):
    layer = _layer(cfg, single_process_mesh())
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.pow(2).sum().backward()
    return layer, y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_dropless_equals_infinite_capacity_and_capacity_drops():
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(0))
    _, y0, gx0, g0 = _layer_outputs(cfg_of(), x)
    _, y1, gx1, g1 = _layer_outputs(cfg_of("model.moe_capacity_factor=1000"), x)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    layer, y2, _, _ = _layer_outputs(cfg_of("model.moe_capacity_factor=0.5"), x)
    dropped, assigned = layer.step_stats[4].item(), layer.step_stats[5].item()
    assert assigned == 64 and dropped >= 32  # at most ceil(0.5 * 32 * 2 / 4) = 8 per expert are kept
    assert not torch.equal(y0, y2)


def test_layer_equals_a_loop_over_tokens():
    cfg = cfg_of("model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0")
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(1))
    layer = _layer(cfg, single_process_mesh())
    y = layer(x).detach()
    w_r = layer.router.weight.detach()
    up, down = layer.experts.up_proj.weight.detach(), layer.experts.down_proj.weight.detach()
    for s in range(6):
        for b in range(2):
            t = x[s, b]
            p = torch.softmax(w_r @ t, -1)
            top = torch.topk(p, 2).indices
            out = torch.zeros(64)
            for e in top.tolist():
                gate, u = (up[e] @ t).chunk(2)
                out += p[e] / p[top].sum() * (down[e] @ (torch.nn.functional.silu(gate) * u))
            torch.testing.assert_close(y[s, b], out, rtol=1e-4, atol=1e-4)  # float32 GEMM vs matvec order


def test_each_expert_is_initialised_from_its_own_name():
    cfg = cfg_of()
    model = build_model(cfg, single_process_mesh())
    w = model.layers["1"].mlp.experts.down_proj.weight
    want = full_init(
        "layers.1.mlp.experts.3.down_proj.weight",
        tuple(w.shape[1:]),
        cfg.train.seed,
        cfg.model.init_std,
        cfg.model.num_layers,
    )
    assert torch.equal(w[3].detach(), want)


def test_forced_imbalance_is_flagged_and_the_bias_pushes_back():
    from tests.forms import build_data, microbatches

    cfg = cfg_of("model.moe_expert_bias=true", "model.moe_bias_update_rate=0.5", "model.moe_aux_loss_coeff=0")
    mesh = single_process_mesh()
    model = build_model(cfg, mesh)
    with torch.no_grad():
        for _, layer in stats.moe_layers(model):
            layer.router.weight.zero_()  # every score equal: the bias alone picks experts 0 and 1
            layer.router.expert_bias.copy_(torch.tensor([2.0, 1.0, 0.0, 0.0]))
    opt = build_optimizer(model, cfg.optim, mesh)
    t = cfg.train
    train_step(
        model,
        opt,
        microbatches(build_data(cfg), 0, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed),
        mesh,
        cfg,
        1,
    )
    row = {"step": 1, **stats.metrics(model, mesh)}
    tokens = t.global_batch_size * cfg.model.seq_length
    assert row["moe/layer0/tokens_min"] == 0 and row["moe/layer0/tokens_max"] == tokens
    assert row["moe/layer0/tokens_cv"] == pytest.approx(1.0)  # loads [T, T, 0, 0]
    assert row["moe/layer0/router_entropy"] == pytest.approx(math.log(4), rel=1e-5)
    warnings = stats.imbalance_warnings(row, cfg.model.num_layers)
    assert len(warnings) == 2 and "layer 0" in warnings[0], warnings
    bias = model.layers["0"].mlp.router.expert_bias  # 2 - 0.5, 1 - 0.5, +0.5, +0.5, recentred
    torch.testing.assert_close(bias, torch.tensor([1.5, 0.5, 0.5, 0.5]) - 0.75)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["grouped", "padded"])
def test_grouped_experts_equal_the_per_expert_loop(dtype, path, monkeypatch):
    """One grouped GEMM per projection (or the padded bmm where the backend has none) gives the loop's
    outputs and grads exactly, empty experts included (their grads are zeros, as in the loop)."""
    from megaframe.model.moe import grouped
    from megaframe.model.moe.layer import Experts
    from megaframe.parallel.mesh import single_process_mesh

    if path == "padded":
        monkeypatch.setattr(grouped, "grouped_supported", lambda x: False)
    cfg = load_config(["data=synthetic", "model=moe_tiny", "model.vocab_size=64"], world_size=1).model
    experts = Experts(cfg, single_process_mesh(), False).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    sizes = [5, 0, 11, 3] + [0] * (cfg.num_experts - 4)
    x = torch.randn(sum(sizes), cfg.hidden_size, dtype=dtype, requires_grad=True)
    g = torch.randn(sum(sizes), cfg.hidden_size, dtype=dtype)
    w = torch.rand(sum(sizes), 1, requires_grad=True)  # the router's fp32 combine weights
    outs = []
    for weights in (None, w):
        for fn in (experts.forward, experts.forward_loop):
            y = fn(x, sizes, w_N1=weights)
            wrt = (x, *experts.parameters()) + ((w,) if weights is not None else ())
            outs.append((y, *torch.autograd.grad(y, wrt, g)))
    outs = [outs[0] + outs[2], outs[1] + outs[3]]
    for a, b in zip(*outs):  # grouped: bit for bit; bmm blocks its sums differently from mm (fp32 1e-5)
        if path == "grouped":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_weighted_swiglu_is_the_eager_product_and_its_grads():
    """silu(gate) · up · w with silu recomputed in backward: the eager expression's grads (float64)."""
    from megaframe.model.moe import grouped

    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(7, 10, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(7, 1, dtype=torch.float64, generator=g, requires_grad=True)
    dh = torch.randn(7, 5, dtype=torch.float64, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up * w
    got = grouped.weighted_swiglu(gate_up, w)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (gate_up, w), dh), torch.autograd.grad(want, (gate_up, w), dh)):
        torch.testing.assert_close(a, b)


def test_a_layer_keeps_its_routed_rows_once():
    """What one MoE layer's backward keeps per routed row (T·K rows, real routing on CPU, fp32): the
    experts' input once, their [gate | up] and the down projection's input, the fp32 combine weight and
    two int64 indices (which token, which weight). The row moves and the combine keep indices only; the
    weights are applied inside the experts, so no expert output row is kept."""
    cfg = cfg_of()
    layer = _layer(cfg, single_process_mesh())
    s, b, d, f, k = 16, 2, cfg.model.hidden_size, cfg.model.expert_ffn, cfg.model.moe_top_k
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    saved: dict[int, tuple[int, int]] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            saved.setdefault(key, (t.shape[0] if t.dim() else 0, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(s, b, d, requires_grad=True))
    rows = s * b * k
    routed = sum(n for first, n in saved.values() if first == rows)
    assert routed == rows * (4 * (d + 2 * f + f) + 4 + 2 * 8)


def test_forced_balance_routes_by_position_and_loads_every_expert_alike():
    """model.moe_force_balance: the experts of a token follow its sequence position, (p + j·E/K) mod E, not
    its scores; each expert takes the same rows; the combine weights are those experts' renormalised scores,
    so the router's gate still gets a gradient."""
    cfg = cfg_of("model.moe_force_balance=true")
    e, k = cfg.model.num_experts, cfg.model.moe_top_k
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(0))
    layer, y, _, grads = _layer_outputs(cfg, x)
    assert layer.step_stats[:e].tolist() == [16 * 2 * k / e] * e  # 32 tokens x 2 over 4 experts
    assert grads["router.weight"].abs().sum() > 0
    forced_TK = layer._forced_experts(16, 2, x.device)
    # positions 0, 0, 1, 1 (sequence-major); a token's 2 experts lie E/K = 2 apart (on ep2, one on each rank)
    assert forced_TK[:4].tolist() == [[0, 2], [0, 2], [1, 3], [1, 3]]
    r = router.route(layer.router(x.reshape(-1, 64)), k, forced_TK=forced_TK)
    chosen_TK = r.probs_TE.gather(-1, forced_TK)
    torch.testing.assert_close(r.weights_TK, chosen_TK / chosen_TK.sum(-1, keepdim=True))
    _, y_free, _, _ = _layer_outputs(cfg_of(), x)
    assert not torch.equal(y, y_free)  # the scores would have chosen otherwise
